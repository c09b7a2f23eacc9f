"""GGUF checkpoints (llama.cpp format): metadata -> HF config, tensor names -> HF names, dequantization.

Quirks handled here:

* GGUF stores dimensions fastest-first (``ne0`` = row length), the reverse of torch; ``gguf.GGUFReader``
  already exposes ``tensor.data`` in numpy (row-major) order, whose shape equals the HF ``[out, in]``
  layout.  For quantized types ``tensor.data`` is the raw ``uint8`` block bytes, one row per output row.
* llama.cpp's converter permutes the rows of ``attn_q``/``attn_k`` of ``llama`` models for its rotary
  layout; we undo it exactly like ``transformers`` (``LlamaTensorProcessor._reverse_permute_weights``).
  Qwen2/Qwen3 are not permuted.
* Quantized tensors dequantize to float32; F16/BF16 keep their dtype; F32 stays float32.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, ReaderField, ReaderTensor
from gguf.quants import dequantize

from splitserve.model.checkpoint_format import MODEL_TYPE_TO_ARCHITECTURE, sample_data_digest
from splitserve.model.errors import ModelLoadError
from splitserve.model.generation_defaults import GGUF_CONFIG_KEY, gguf_sampling

logger = logging.getLogger(__name__)

#: GGUF ``general.architecture`` -> HF ``model_type``.
GGUF_ARCH_TO_MODEL_TYPE: dict[str, str] = {"llama": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}

_Q = GGMLQuantizationType
SUPPORTED_GGML_TYPES: tuple[GGMLQuantizationType, ...] = (_Q.F32, _Q.F16, _Q.BF16, _Q.Q8_0, _Q.Q4_0, _Q.Q4_1)

_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_BLOCK_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z_]+)\.(weight|bias)$")
# Tensors with no HF parameter counterpart.  rope_freqs holds llama3-style precomputed RoPE frequency
# factors; HF derives them from config.rope_scaling instead.
_IGNORED_TENSORS = frozenset({"rope_freqs.weight"})
_CORRUPT_HINT = "the file is not a valid GGUF file or is truncated; re-download it"


@dataclass(frozen=True)
class _Entry:
    index: int  # position in GGUFReader.tensors
    gguf_name: str
    hf_name: str
    n_heads_for_unpermute: int | None  # set for llama q/k tensors


class GGUFSource:
    """Lazily dequantizes the tensors of one GGUF file (picklable: the reader is reopened on demand)."""

    def __init__(self, path: Path, entries: list[_Entry], reader: GGUFReader | None = None) -> None:
        self.path = path
        self._entries = entries
        self._reader = reader

    def state(self) -> list[list[Any]]:
        """JSON-ready tensor table, for `from_state` (memoizing a parsed header)."""
        return [[e.index, e.gguf_name, e.hf_name, e.n_heads_for_unpermute] for e in self._entries]

    @classmethod
    def from_state(cls, path: Path, state: list[list[Any]]) -> GGUFSource:
        """A source whose file is parsed only when its tensors are read."""
        entries = [_Entry(int(i), str(g), str(h), None if n is None else int(n)) for i, g, h, n in state]
        return cls(path, entries)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_reader"] = None  # a memmap-backed reader must not be pickled
        return state

    def _get_reader(self) -> GGUFReader:
        if self._reader is None:
            self._reader = read_gguf(self.path)
        return self._reader

    def tensor_names(self) -> list[str]:
        return [entry.hf_name for entry in self._entries]

    def iter_tensors(
        self, names: Collection[str] | None = None, timings: dict[str, float] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        reader = self._get_reader()
        wanted = None if names is None else set(names)
        for entry in self._entries:
            if wanted is not None and entry.hf_name not in wanted:
                continue
            tensor = tensor_to_torch(reader.tensors[entry.index], self.path, timings)
            if entry.n_heads_for_unpermute is not None:
                t = time.perf_counter()
                tensor = reverse_llama_permute(
                    tensor, entry.n_heads_for_unpermute, entry.gguf_name, self.path
                )
                if timings is not None:
                    timings["convert"] = timings.get("convert", 0.0) + time.perf_counter() - t
            yield entry.hf_name, tensor

    def files(self) -> list[Path]:
        return [self.path]

    def fingerprint_parts(self) -> Iterator[bytes]:
        reader = self._get_reader()
        # Everything before the data section: magic, version, all metadata and all tensor infos.
        yield bytes(reader.data[: reader.data_offset])
        yield sample_data_digest(self.path, int(reader.data_offset))


def read_gguf(path: Path) -> GGUFReader:
    """Open ``path`` with ``gguf.GGUFReader``, turning header problems into :class:`ModelLoadError`."""
    try:
        with path.open("rb") as fh:
            magic = fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read file: {exc.strerror or exc}", path=path) from exc
    if magic != b"GGUF":
        raise ModelLoadError(
            f"not a GGUF file (magic bytes {magic!r}, expected b'GGUF')", path=path, hint=_CORRUPT_HINT
        )
    try:
        return GGUFReader(path)
    except Exception as exc:  # the reader raises ValueError/KeyError/IndexError/... on bad input
        raise ModelLoadError(
            f"corrupt or truncated GGUF file (gguf.GGUFReader: {type(exc).__name__}: {exc})",
            path=path,
            hint=_CORRUPT_HINT,
        ) from exc


def open_gguf(path: Path) -> tuple[dict[str, Any], GGUFSource]:
    """Parse and validate a GGUF file; return its HF-style config and a lazy tensor source."""
    reader = read_gguf(path)
    meta = _Metadata(reader, path)
    arch = meta.require("general.architecture")
    if arch not in GGUF_ARCH_TO_MODEL_TYPE:
        arches = GGUF_ARCH_TO_MODEL_TYPE.items()
        known = ", ".join(f"{a} (-> {MODEL_TYPE_TO_ARCHITECTURE[t]})" for a, t in arches)
        raise ModelLoadError(f"unsupported GGUF architecture {arch!r}", path=path,
                             hint=f"supported GGUF architectures: {known}")  # fmt: skip
    config = build_hf_config(reader, meta, arch)
    sampling = {k: meta.get(k) for k in reader.fields if k.startswith("general.sampling.")}
    if defaults := gguf_sampling(sampling):  # llama.cpp's sampling defaults, for the router
        config[GGUF_CONFIG_KEY] = defaults
    entries = _map_tensors(reader, path, arch, config)
    return config, GGUFSource(path, entries, reader)


class _Metadata:
    """Typed access to GGUF key/value metadata."""

    def __init__(self, reader: GGUFReader, path: Path) -> None:
        self._fields = reader.fields
        self._path = path

    def get(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else _field_value(field)

    def require(self, key: str) -> Any:
        value = self.get(key)
        if value is None:
            raise ModelLoadError(
                f"required GGUF metadata key {key!r} is missing", path=self._path, hint=_CORRUPT_HINT
            )
        return value

    def array_length(self, key: str) -> int | None:
        field = self._fields.get(key)
        return None if field is None else len(field.data)


def _field_value(field: ReaderField) -> Any:
    """Decode a scalar/string field, or a numeric array as a list (string arrays are not decoded)."""
    if not field.types:
        return None
    kind = field.types[0]
    if kind == GGUFValueType.ARRAY:
        if field.types[-1] == GGUFValueType.STRING:
            return None
        return [_number(field.parts[i][0], field.types[-1]) for i in field.data]
    part = field.parts[field.data[0]]
    if kind == GGUFValueType.STRING:
        return bytes(part).decode("utf-8", errors="replace")
    return _number(part[0], kind)


def _number(value: Any, kind: GGUFValueType) -> Any:
    if kind == GGUFValueType.FLOAT32:
        # float32 metadata (e.g. rms eps 1e-5) -> the shortest decimal that round-trips, like config.json.
        return float(str(np.float32(value)))
    return value.item() if hasattr(value, "item") else value


def _uniform(value: Any, key: str, path: Path) -> int:
    """Per-layer arrays (some converters write them) must be uniform for the supported models."""
    if isinstance(value, list):
        if not value or len(set(value)) != 1:
            raise ModelLoadError(f"per-layer values for {key!r} differ ({value}); not supported", path=path)
        value = value[0]
    return int(value)


def build_hf_config(reader: GGUFReader, meta: _Metadata, arch: str) -> dict[str, Any]:
    """Synthesize a Hugging Face ``config.json`` dict from GGUF metadata."""
    path, p = meta._path, f"{arch}."
    model_type = GGUF_ARCH_TO_MODEL_TYPE[arch]
    hidden = int(meta.require(p + "embedding_length"))
    heads = _uniform(meta.require(p + "attention.head_count"), p + "attention.head_count", path)
    kv_heads = _uniform(meta.get(p + "attention.head_count_kv", heads), p + "attention.head_count_kv", path)
    head_dim = meta.get(p + "attention.key_length")
    if head_dim is None and arch == "llama":
        head_dim = meta.get(p + "rope.dimension_count")
    names = {t.name for t in reader.tensors}
    config: dict[str, Any] = {
        "architectures": [MODEL_TYPE_TO_ARCHITECTURE[model_type]],
        "model_type": model_type,
        "vocab_size": _vocab_size(reader, meta, p),
        "hidden_size": hidden,
        "intermediate_size": _uniform(
            meta.require(p + "feed_forward_length"), p + "feed_forward_length", path
        ),
        "num_hidden_layers": int(meta.require(p + "block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": int(head_dim) if head_dim is not None else hidden // heads,
        "hidden_act": "silu",
        "rms_norm_eps": float(meta.require(p + "attention.layer_norm_rms_epsilon")),
        "rope_theta": float(meta.get(p + "rope.freq_base", 10000.0)),
        "max_position_embeddings": int(meta.require(p + "context_length")),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": arch == "qwen2" or any(n.endswith(".attn_q.bias") for n in names),
        "mlp_bias": False,
        "torch_dtype": "float32",
    }
    for gguf_key, hf_key in (("bos", "bos_token_id"), ("eos", "eos_token_id"), ("padding", "pad_token_id")):
        token_id = meta.get(f"tokenizer.ggml.{gguf_key}_token_id")
        if token_id is not None:
            config[hf_key] = int(token_id)
    rope_scaling = _rope_scaling(meta, p)
    if rope_scaling is not None:
        config["rope_scaling"] = rope_scaling
    elif "rope_freqs.weight" in names:
        logger.warning(
            "%s: has a rope_freqs tensor (llama3-style RoPE scaling) but no rope.scaling metadata; "
            "it is ignored, so contexts beyond the original training length may degrade",
            path,
        )
    return config


def _vocab_size(reader: GGUFReader, meta: _Metadata, prefix: str) -> int:
    vocab = meta.get(prefix + "vocab_size")
    if vocab is None:
        vocab = meta.array_length("tokenizer.ggml.tokens")
    if vocab is None:
        embd = next((t for t in reader.tensors if t.name == "token_embd.weight"), None)
        if embd is None:
            raise ModelLoadError(
                "cannot determine vocab_size (no metadata, tokens or token_embd)", path=meta._path
            )
        vocab = int(embd.shape[-1])
    return int(vocab)


def _rope_scaling(meta: _Metadata, p: str) -> dict[str, Any] | None:
    kind = meta.get(p + "rope.scaling.type")
    if kind is None and meta.get(p + "rope.scale_linear") is not None:  # legacy key
        return {"rope_type": "linear", "type": "linear", "factor": float(meta.get(p + "rope.scale_linear"))}
    if kind is None or kind == "none":
        return None
    scaling: dict[str, Any] = {"rope_type": kind, "type": kind}
    optional = {
        "rope.scaling.factor": "factor",
        "rope.scaling.original_context_length": "original_max_position_embeddings",
        "rope.scaling.attn_factor": "attention_factor",
        "rope.scaling.yarn_beta_fast": "beta_fast",
        "rope.scaling.yarn_beta_slow": "beta_slow",
    }
    for gguf_key, hf_key in optional.items():
        value = meta.get(p + gguf_key)
        if value is not None:
            scaling[hf_key] = value
    return scaling


def gguf_to_hf_name(name: str) -> str | None:
    """HF parameter name for a GGUF tensor name (``None`` when it has no block-level mapping)."""
    if name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[name]
    match = _BLOCK_RE.match(name)
    if match is None or match.group(2) not in _BLOCK_NAMES:
        return None
    layer, part, kind = match.groups()
    return f"model.layers.{layer}.{_BLOCK_NAMES[part]}.{kind}"


def _map_tensors(reader: GGUFReader, path: Path, arch: str, config: dict[str, Any]) -> list[_Entry]:
    entries: list[_Entry] = []
    for index, tensor in enumerate(reader.tensors):
        name = tensor.name
        if name in _IGNORED_TENSORS:
            continue
        if tensor.tensor_type not in SUPPORTED_GGML_TYPES:
            raise ModelLoadError(
                f"unsupported quantization type {tensor.tensor_type.name} in tensor {name}; "
                f"supported: {', '.join(t.name for t in SUPPORTED_GGML_TYPES)}",
                path=path,
                hint="use a GGUF quantized to one of those, e.g. Q8_0, Q4_0 or F16",
            )
        hf_name = gguf_to_hf_name(name)
        if hf_name is None:
            raise ModelLoadError(f"unexpected tensor {name!r} for GGUF architecture {arch!r}", path=path)
        n_heads = None
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            key = "num_attention_heads" if ".attn_q." in name else "num_key_value_heads"
            n_heads = int(config[key])
        entries.append(_Entry(index, name, hf_name, n_heads))
    return entries


def tensor_to_torch(
    tensor: ReaderTensor, path: Path, timings: dict[str, float] | None = None
) -> torch.Tensor:
    """Copy a GGUF tensor out of the memory map as a torch tensor in HF layout.

    ``timings``: seconds copying out of the map ("read") and dequantizing ("convert") are added."""
    qtype = tensor.tensor_type
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))  # GGUF ne[] is fastest-first
    t0 = time.perf_counter()
    try:
        if qtype == _Q.F32:
            array = np.array(tensor.data, dtype=np.float32)
        elif qtype == _Q.F16:
            array = np.array(tensor.data, dtype=np.float16)
        elif qtype == _Q.BF16:
            raw = np.array(tensor.data, dtype=np.uint8).view(np.int16)
            _add_time(timings, "read", t0)
            return torch.from_numpy(raw).view(torch.bfloat16).reshape(shape)
        else:
            blocks = np.array(tensor.data)  # the read: pages come in here, not in dequantize
            t1 = _add_time(timings, "read", t0)
            array = np.ascontiguousarray(dequantize(blocks, qtype), dtype=np.float32)
            _add_time(timings, "convert", t1)
            return torch.from_numpy(array).reshape(shape)
        _add_time(timings, "read", t0)
        return torch.from_numpy(array).reshape(shape)
    except (ValueError, RuntimeError, NotImplementedError) as exc:
        raise ModelLoadError(
            f"cannot decode tensor {tensor.name} ({qtype.name}, shape {list(shape)}): {exc}",
            path=path,
            hint=_CORRUPT_HINT,
        ) from exc


def _add_time(timings: dict[str, float] | None, key: str, since: float) -> float:
    now = time.perf_counter()
    if timings is not None:
        timings[key] = timings.get(key, 0.0) + now - since
    return now


def reverse_llama_permute(weight: torch.Tensor, n_heads: int, name: str, path: Path) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation (rotary interleaving) for a ``[out, ...]`` weight or bias.

    Same as transformers' ``LlamaTensorProcessor._reverse_permute_weights``; ``n_heads`` is the number
    of attention heads for ``attn_q`` and of key/value heads for ``attn_k``.
    """
    rows = weight.shape[0]
    if rows % (2 * n_heads) != 0:
        raise ModelLoadError(
            f"tensor {name} has {rows} rows, not divisible by 2 x {n_heads} heads", path=path
        )
    dim = rows // n_heads // 2
    return (
        weight.reshape(n_heads, dim, 2, *weight.shape[1:]).transpose(1, 2).reshape(weight.shape).contiguous()
    )
