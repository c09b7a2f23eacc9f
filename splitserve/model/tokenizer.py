"""Tokenizer and chat template, both taken from the checkpoint (tokenizer.json or GGUF metadata).

Two ways to the same tokens:
  - light (`LightTokenizer`): the `tokenizers` library on the checkpoint's `tokenizer.json` (for a GGUF,
    the one converted once and cached, see `load_tokenizer`), the chat template rendered with jinja2
    (chat_render.py). The router and the workers' front ends load this one: no transformers import.
    It is taken where the checkpoint's tokenizer_config names a tokenizer class that only wraps
    tokenizer.json (`LIGHT_CLASSES`) and sets no option that rewrites it (`add_bos_token`, ...).
  - transformers' fast tokenizer otherwise, and to convert a GGUF vocabulary in the first place.
Both expose the same methods; `hf` is transformers' tokenizer (loaded on first use by a light one: the
engine's grammar compiler needs it). The `tokenizers` library's `DecodeStream` does incremental
detokenization for streaming.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from tokenizers import Tokenizer as RustTokenizer
from tokenizers.decoders import DecodeStream

from splitserve.model import chat_render
from splitserve.model.errors import ModelLoadError

log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")
# tokenizer classes that are tokenizer.json as it is (transformers adds nothing when it loads them)
LIGHT_CLASSES = {"TokenizersBackend", "PreTrainedTokenizerFast"}
_REWRITES = ("add_bos_token", "add_eos_token", "add_prefix_space", "legacy", "from_slow")
_SPECIAL = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class Tokenizer:
    """transformers' fast tokenizer of a checkpoint."""

    def __init__(self, hf_tokenizer: Any, extra_eos_ids: tuple[int, ...] = ()) -> None:
        self._hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        eos = {hf_tokenizer.eos_token_id, *extra_eos_ids} - {None}
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self.vocab_size = len(hf_tokenizer)

    @property
    def hf(self) -> Any:
        return self._hf

    @property
    def chat_template(self) -> str | dict | None:
        """The checkpoint's chat template (a dict of named ones where it has several), or None."""
        return getattr(self._hf, "chat_template", None)

    def set_chat_template(self, template: str) -> None:
        """Render chats with `template` in place of the checkpoint's (vLLM's --chat-template)."""
        self._hf.chat_template = template

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, eos_ids: tuple[int, ...] = (), cache_key: str | None = None
    ) -> Tokenizer | None:
        """Load from an HF directory or a GGUF file; None when a directory ships no tokenizer.

        A GGUF vocabulary takes seconds to convert; with `cache_key` (the checkpoint fingerprint) the
        converted tokenizer is saved under the cache directory and reloaded from there next time.
        """
        path = Path(path)
        try:
            if path.is_file():
                if (light := _open_cached(_cached_gguf_dir(cache_key), eos_ids)) is not None:
                    return light
                tok = _load_gguf_tokenizer(path, cache_key)  # converts it (again, when corrupt)
            elif any((path / f).exists() for f in _TOKENIZER_FILES):
                light = LightTokenizer.open(path, eos_ids + _generation_eos(path))
                if light is not None:
                    return light
                from transformers import AutoTokenizer

                tok = AutoTokenizer.from_pretrained(str(path))
            else:
                log.warning("%s has no tokenizer files: only token-id prompts will be accepted", path)
                return None
        except Exception as exc:  # transformers raises many types here
            raise ModelLoadError(f"could not load the tokenizer from {path}: {exc}") from exc
        return cls(tok, eos_ids + _generation_eos(path))

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        if not getattr(self.hf, "chat_template", None):
            raise ValueError("this model has no chat template; use a completion prompt instead")
        out = self.hf.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True, **kwargs
        )
        if isinstance(out, dict) or hasattr(out, "input_ids"):
            out = out["input_ids"]
        return list(out)

    def token_text(self, token_id: int) -> str:
        return self.hf.decode([token_id], skip_special_tokens=False)

    def decode_stream(self, skip_special_tokens: bool = True) -> IncrementalDecoder:
        return IncrementalDecoder(self, skip_special_tokens)


class LightTokenizer(Tokenizer):
    """A checkpoint's tokenizer.json through the `tokenizers` library, its chat template through jinja2:
    the same ids and text as transformers' tokenizer of the same files (tests/model/test_tokenizer.py)."""

    def __init__(
        self, folder: Path, backend: RustTokenizer, config: dict[str, Any], template: str | dict | None,
        extra_eos_ids: tuple[int, ...] = (),
    ) -> None:  # fmt: skip
        self.folder, self.backend, self.template = folder, backend, template
        self._hf = None
        self.special_tokens = {k: _content(config[k]) for k in _SPECIAL if config.get(k) is not None}
        # transformers leaves BPE text as it is even where the config asks for the clean-up
        bpe = type(backend.model).__name__ == "BPE"
        self.clean_up_spaces = bool(config.get("clean_up_tokenization_spaces", False)) and not bpe
        eos = self.special_tokens.get("eos_token")
        eos_id = backend.token_to_id(eos) if eos is not None else None
        self.eos_token_ids = tuple(sorted({eos_id, *extra_eos_ids} - {None}))
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)

    @classmethod
    def open(cls, folder: Path, extra_eos_ids: tuple[int, ...] = ()) -> LightTokenizer | None:
        """None where transformers must load this folder's tokenizer (see the module's docstring)."""
        config_file = folder / "tokenizer_config.json"
        if not (folder / "tokenizer.json").exists() or not config_file.exists():
            return None
        config = json.loads(config_file.read_text(encoding="utf-8"))
        if config.get("tokenizer_class") not in LIGHT_CLASSES or any(k in config for k in _REWRITES):
            return None
        template: str | dict | None = config.get("chat_template")
        if (folder / "chat_template.jinja").exists():
            template = (folder / "chat_template.jinja").read_text(encoding="utf-8")
        if isinstance(template, list):  # named templates
            template = {t["name"]: t["template"] for t in template}
        if isinstance(template, dict) and any("{% generation" in t for t in template.values()):
            return None
        if isinstance(template, str) and "{% generation" in template:
            return None
        backend = RustTokenizer.from_file(str(folder / "tokenizer.json"))
        return cls(folder, backend, config, template, extra_eos_ids)

    @property
    def chat_template(self) -> str | dict | None:
        return self.template

    def set_chat_template(self, template: str) -> None:
        self.template = template
        if self._hf is not None:
            self._hf.chat_template = template

    @property
    def hf(self) -> Any:
        """transformers' tokenizer of the same folder, loaded on first use (the grammar compiler's)."""
        if self._hf is None:
            from transformers import AutoTokenizer

            self._hf = AutoTokenizer.from_pretrained(str(self.folder))
        return self._hf

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.backend.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        text = self.backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return _clean_up_spaces(text) if self.clean_up_spaces else text

    def token_text(self, token_id: int) -> str:
        return self.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self, messages: list[dict[str, Any]], add_generation_prompt: bool = True, **kwargs: Any
    ) -> list[int]:
        source = _pick_template(self.template, kwargs.pop("chat_template", None), kwargs.get("tools"))
        if not source:
            raise ValueError("this model has no chat template; use a completion prompt instead")
        text = chat_render.render(source, messages, self.special_tokens, add_generation_prompt, **kwargs)
        return self.encode(text, add_special_tokens=False)


class IncrementalDecoder:
    """Accumulates text one token at a time, correct across multi-byte characters."""

    def __init__(self, tokenizer: Tokenizer, skip_special_tokens: bool) -> None:
        self._backend = tokenizer.backend
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.text = ""

    def step(self, token_id: int) -> str:
        piece = self._stream.step(self._backend, token_id) or ""
        self.text += piece
        return piece


def load_tokenizer(
    model: str | os.PathLike | None,
    tokenizer: str | os.PathLike | None = None,
    eos_ids: tuple[int, ...] = (),
    checkpoint: Any = None,
) -> Tokenizer | None:
    """The tokenizer of a model source (see `checkpoint.tokenizer_path`: `tokenizer` if given, else the
    model's own, else for a `random:` model the embedded default model's). A GGUF's converted tokenizer
    is cached under its fingerprint: `checkpoint`'s (the model's opened checkpoint, when it is that
    file), else the one the weight cache remembered with the file's parsed header (`gguf_fingerprint`:
    gguf's reader takes 6 s for SmolLM2's header on a slow core, and the router and each worker load a
    tokenizer)."""
    from splitserve.model.checkpoint_path import tokenizer_path

    path = tokenizer_path(model, tokenizer)
    key = None
    if path.is_file():
        same = checkpoint is not None and Path(checkpoint.path).resolve() == path.resolve()
        key = checkpoint.fingerprint() if same else gguf_fingerprint(path)
    return Tokenizer.from_checkpoint(path, eos_ids, cache_key=key)


def gguf_fingerprint(path: Path) -> str:
    """A GGUF file's fingerprint: from the memo `weight_cache.open_checkpoint_memo` keeps while the file is
    unchanged (read here without torch or gguf), else by opening it (which writes the memo)."""
    from splitserve.model.checkpoint_memo import memo_file, signature

    with_memo = memo_file(path, cache_dir() / "weights")
    try:
        data = json.loads(with_memo.read_text(encoding="utf-8"))
        if data["sig"] == signature(path):
            return str(data["fingerprint"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    from splitserve.model.weight_cache import default_cache_dir, open_checkpoint_memo

    return open_checkpoint_memo(path, default_cache_dir()).fingerprint()


def cache_dir() -> Path:
    """Where converted artifacts live: $SPLITSERVE_CACHE_DIR, else ~/.cache/splitserve."""
    from splitserve.model.checkpoint_memo import cache_root

    return cache_root()


def _cached_gguf_dir(cache_key: str | None) -> Path | None:
    return cache_dir() / "tokenizers" / cache_key if cache_key else None


def _open_cached(cached: Path | None, eos_ids: tuple[int, ...]) -> LightTokenizer | None:
    """A GGUF's converted tokenizer from the cache; None when there is none, or it is unreadable."""
    if cached is None or not (cached / "tokenizer.json").exists():
        return None
    try:
        return LightTokenizer.open(cached, eos_ids)
    except Exception:  # noqa: BLE001 - a corrupt cache entry is converted again
        log.warning("tokenizer cache %s is unreadable; rebuilding it", cached)
        return None


def _load_gguf_tokenizer(path: Path, cache_key: str | None) -> Any:
    from transformers import AutoTokenizer

    cached = _cached_gguf_dir(cache_key)
    if cached is not None and (cached / "tokenizer.json").exists():
        try:
            return AutoTokenizer.from_pretrained(str(cached))
        except Exception:  # noqa: BLE001 - a corrupt cache entry is rebuilt below
            log.warning("tokenizer cache %s is unreadable; rebuilding it", cached)
    tok = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    if cached is not None:
        tmp = cached.with_name(f"{cached.name}.tmp{os.getpid()}")
        try:
            tok.save_pretrained(str(tmp))
            shutil.rmtree(cached, ignore_errors=True)  # a stale or broken entry
            tmp.rename(cached)  # atomic: readers see a whole entry or none
        except OSError as exc:
            log.warning("could not cache the tokenizer in %s: %s", cached, exc)
            shutil.rmtree(tmp, ignore_errors=True)
    return tok


def _generation_eos(path: Path) -> tuple[int, ...]:
    cfg = path / "generation_config.json" if path.is_dir() else None
    if cfg is None or not cfg.exists():
        return ()
    eos = json.loads(cfg.read_text()).get("eos_token_id")
    if eos is None:
        return ()
    return tuple(eos) if isinstance(eos, list) else (eos,)


def _content(token: Any) -> str:
    """A special token as tokenizer_config.json gives it: a string, or an AddedToken's dict."""
    return token["content"] if isinstance(token, dict) else str(token)


def _pick_template(template: str | dict | None, asked: str | None, tools: Any) -> str | None:
    """The template to render: `asked` (a template's source or name) or the checkpoint's (of named
    templates, "tool_use" with tools, else "default"), as transformers picks."""
    if isinstance(template, dict):
        if asked is not None and asked in template:
            return template[asked]
        if asked is None:
            if tools is not None and "tool_use" in template:
                return template["tool_use"]
            if "default" in template:
                return template["default"]
            raise ValueError(f"this model has several chat templates, none the default: {sorted(template)}")
    return asked if asked is not None else template


def _clean_up_spaces(text: str) -> str:
    """transformers' `clean_up_tokenization`: no space before punctuation and English contractions."""
    for a, b in ((" .", "."), (" ?", "?"), (" !", "!"), (" ,", ","), (" ' ", "'"), (" n't", "n't"),
                 (" 'm", "'m"), (" 's", "'s"), (" 've", "'ve"), (" 're", "'re")):  # fmt: skip
        text = text.replace(a, b)
    return text
