"""Tokenizer and chat template, both taken from the checkpoint (tokenizer.json or GGUF metadata).

transformers builds the fast tokenizer (it knows how to convert GGUF vocabularies); the `tokenizers`
library's `DecodeStream` does incremental detokenization for streaming.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from tokenizers.decoders import DecodeStream

from splitserve.model.errors import ModelLoadError

log = logging.getLogger(__name__)
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


class Tokenizer:
    def __init__(self, hf_tokenizer: Any, extra_eos_ids: tuple[int, ...] = ()) -> None:
        self.hf = hf_tokenizer
        self.backend = hf_tokenizer.backend_tokenizer
        eos = {hf_tokenizer.eos_token_id, *extra_eos_ids} - {None}
        self.eos_token_ids: tuple[int, ...] = tuple(sorted(eos))
        self.vocab_size = len(hf_tokenizer)

    @classmethod
    def from_checkpoint(
        cls, path: str | os.PathLike, eos_ids: tuple[int, ...] = (), cache_key: str | None = None
    ) -> Tokenizer | None:
        """Load from an HF directory or a GGUF file; None when a directory ships no tokenizer.

        A GGUF vocabulary takes seconds to convert; with `cache_key` (the checkpoint fingerprint) the
        converted tokenizer is saved under the cache directory and reloaded from there next time.
        """
        from transformers import AutoTokenizer

        path = Path(path)
        try:
            if path.is_file():
                tok = _load_gguf_tokenizer(path, cache_key)
            elif any((path / f).exists() for f in _TOKENIZER_FILES):
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
    model's own, else for a `random:` model the embedded default model's). `checkpoint`: the model's
    opened checkpoint, reused for the GGUF tokenizer's cache key when it is that file. Otherwise the
    file's parsed header is memoized beside the weight cache's (`open_checkpoint_memo`): gguf's reader
    takes 6 s for SmolLM2's header on a slow core, and the router and each worker load a tokenizer."""
    from splitserve.model.checkpoint import tokenizer_path
    from splitserve.model.weight_cache import default_cache_dir, open_checkpoint_memo

    path = tokenizer_path(model, tokenizer)
    key = None
    if path.is_file():
        same = checkpoint is not None and Path(checkpoint.path).resolve() == path.resolve()
        key = (checkpoint if same else open_checkpoint_memo(path, default_cache_dir())).fingerprint()
    return Tokenizer.from_checkpoint(path, eos_ids, cache_key=key)


def cache_dir() -> Path:
    """Where converted artifacts live: $SPLITSERVE_CACHE_DIR, else ~/.cache/splitserve."""
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    return Path(env) if env else Path.home() / ".cache" / "splitserve"


def _load_gguf_tokenizer(path: Path, cache_key: str | None) -> Any:
    from transformers import AutoTokenizer

    cached = cache_dir() / "tokenizers" / cache_key if cache_key else None
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
