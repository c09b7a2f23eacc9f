"""Format-agnostic access to model checkpoints (Hugging Face safetensors directories and GGUF files).

``open_checkpoint`` inspects a path, validates it eagerly (config, architecture, file headers, quantization
types) and returns a :class:`Checkpoint` whose tensors are read lazily, one at a time, with Hugging Face
parameter names and layouts, whatever the on-disk format.  The format-specific work lives in
``safetensors_loader`` and ``gguf_loader``; the list of supported architectures and
what the loaders share with this module live in ``checkpoint_format``.
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Collection, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from splitserve.model.checkpoint_format import (
    MODEL_TYPE_TO_ARCHITECTURE,
    SUPPORTED_ARCHITECTURES,
    SUPPORTED_MODEL_TYPES,
    TensorLocation,
    TensorSource,
    sample_data_digest,
)
from splitserve.model.checkpoint_path import (  # noqa: F401 - re-exported: where a model's files are
    DEFAULT_MODEL_DISTRIBUTION,
    DEFAULT_MODEL_FILENAME,
    RANDOM_SOURCE,
    default_model_path,
    is_random_source,
    tokenizer_path,
)
from splitserve.model.errors import ModelLoadError

__all__ = [
    "MODEL_TYPE_TO_ARCHITECTURE",
    "SUPPORTED_ARCHITECTURES",
    "SUPPORTED_MODEL_TYPES",
    "Checkpoint",
    "TensorLocation",
    "TensorSource",
    "check_architecture",
    "default_model_path",
    "is_random_source",
    "open_checkpoint",
    "sample_data_digest",
    "tokenizer_path",
]

CheckpointFormat = Literal["hf", "gguf"]

# Bump when the fingerprint recipe changes, so that stale cache entries are never reused.
_FINGERPRINT_VERSION = b"splitserve-checkpoint-fingerprint-v1"


@dataclass(frozen=True)
class Checkpoint:
    """An opened checkpoint.

    ``hf_config`` is a ``config.json``-style dict in Hugging Face naming (for GGUF files it is synthesized
    from the metadata).  Tensors come out with HF parameter names and HF layouts (``[out, in]`` for linear
    weights); a tied ``lm_head.weight`` is absent when the file does not store it (check
    ``hf_config["tie_word_embeddings"]``).  The object holds no open file handles that would stop it from
    being pickled.
    """

    path: Path
    format: CheckpointFormat
    hf_config: dict[str, Any]
    _source: TensorSource = field(repr=False, compare=False)

    def iter_tensors(
        self, names: Collection[str] | None = None, timings: dict[str, float] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        """Yield ``(hf_name, tensor)`` pairs, reading (and dequantizing) one tensor at a time.

        ``names``: only these tensors. ``timings``: seconds spent reading ("read") and dequantizing or
        reordering ("convert") are added to it.
        """
        return self._source.iter_tensors(names, timings)

    def files(self) -> list[Path]:
        """The files this checkpoint is read from (config and weights)."""
        return self._source.files()

    def tensor_locations(self) -> list[TensorLocation] | None:
        """Raw byte ranges of every tensor, or None when the format needs decoding (GGUF)."""
        locations = getattr(self._source, "tensor_locations", None)
        return None if locations is None else locations()

    def tensor_names(self) -> list[str]:
        """HF names of the stored tensors, in the order ``iter_tensors`` yields them (no data is read)."""
        return self._source.tensor_names()

    def fingerprint(self) -> str:
        """A stable sha256 hex digest identifying these weights, for keying a converted-weight cache.

        It covers the format, the (canonicalized) ``hf_config``, every file's tensor headers/metadata, and
        a few fixed windows sampled from each file's data region (so that two fine-tunes with identical
        headers do not collide).  It does not read whole files and does not depend on path or mtime.
        Computed once per object.
        """
        cached = self.__dict__.get("_fingerprint")
        if cached is not None:
            return str(cached)
        digest = hashlib.sha256(_FINGERPRINT_VERSION)
        _update_framed(digest, self.format.encode())
        config_json = json.dumps(self.hf_config, sort_keys=True, separators=(",", ":"), default=str)
        _update_framed(digest, config_json.encode())
        for part in self._source.fingerprint_parts():
            _update_framed(digest, part)
        object.__setattr__(self, "_fingerprint", digest.hexdigest())  # a cache, not a field
        return digest.hexdigest()


def _update_framed(digest: Any, data: bytes) -> None:
    """Feed ``data`` with a length prefix so that part boundaries are unambiguous."""
    digest.update(len(data).to_bytes(8, "little"))
    digest.update(data)


def check_architecture(config: dict[str, Any], config_path: Path) -> str:
    """Return the HF ``model_type`` of ``config`` or raise :class:`ModelLoadError` if it is unsupported."""
    architectures = config.get("architectures") or []
    if isinstance(architectures, str):
        architectures = [architectures]
    model_type = config.get("model_type")
    for arch in architectures:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if not architectures and model_type in SUPPORTED_MODEL_TYPES:
        return str(model_type)
    described = ", ".join(map(str, architectures)) or f"model_type {model_type!r}"
    raise ModelLoadError(
        f"unsupported model architecture {described}",
        path=config_path,
        hint=f"supported architectures: {_supported_list()}",
    )


def _supported_list() -> str:
    return ", ".join(f"{arch} (model_type {mt!r})" for arch, mt in SUPPORTED_ARCHITECTURES.items())


def _read_magic(path: Path) -> bytes:
    try:
        with path.open("rb") as fh:
            return fh.read(4)
    except OSError as exc:
        raise ModelLoadError(f"cannot read file: {exc.strerror or exc}", path=path) from exc


def open_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Open a Hugging Face model directory or a ``.gguf`` file; raise :class:`ModelLoadError` on problems."""
    p = Path(path).expanduser()
    if not p.exists():
        raise ModelLoadError(
            "no such file or directory",
            path=p,
            hint="pass a Hugging Face model directory (config.json + *.safetensors) or a .gguf file",
        )
    p = p.resolve()
    if p.is_dir():
        from splitserve.model import safetensors_loader

        config = safetensors_loader.read_hf_config(p)
        check_architecture(config, p / "config.json")
        source: TensorSource = safetensors_loader.open_safetensors_dir(p)
        return Checkpoint(path=p, format="hf", hf_config=config, _source=source)
    if p.suffix.lower() == ".gguf" or _read_magic(p) == b"GGUF":
        from splitserve.model import gguf_loader

        config, source = gguf_loader.open_gguf(p)
        check_architecture(config, p)
        return Checkpoint(path=p, format="gguf", hf_config=config, _source=source)
    raise ModelLoadError("not a model checkpoint", path=p, hint=_hint_for_file(p))


def _hint_for_file(p: Path) -> str:
    name = p.name.lower()
    if name.endswith((".bin", ".pt", ".pth")):
        return "PyTorch pickle weights are not supported; convert the model to safetensors"
    if name.endswith(".safetensors") or name in ("config.json", "model.safetensors.index.json"):
        return f"pass the directory that contains it ({p.parent}) instead of the file"
    return "pass a Hugging Face model directory (config.json + *.safetensors) or a .gguf file"


#: A model source `random:SHAPE` (e.g. `random:qwen3-8b`) builds random weights at a named shape
#: (model/random_weights.py) instead of reading a checkpoint: for benchmarks at real model shapes.
