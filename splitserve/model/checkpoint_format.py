"""What the checkpoint opener and its format loaders share: the supported architectures, the tensor-source
protocol, tensor byte locations and the data-sampling digest.

``checkpoint`` opens a path and picks a loader (``safetensors_loader``, ``gguf_loader``); the loaders need
these few names from it. They live here, below all three, so that the opener can import its loaders and the
loaders this module without a cycle.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import torch

#: HF ``architectures[0]`` -> HF ``model_type`` of every model family the engine can run.
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3_5ForCausalLM": "qwen3_5_text",
    "Qwen3_5ForConditionalGeneration": "qwen3_5",  # only the language model is loaded
}
#: HF ``model_type`` values of the supported families.
SUPPORTED_MODEL_TYPES: frozenset[str] = frozenset(SUPPORTED_ARCHITECTURES.values())
#: HF ``model_type`` -> HF architecture class name (the inverse of ``SUPPORTED_ARCHITECTURES``).
MODEL_TYPE_TO_ARCHITECTURE: dict[str, str] = {mt: arch for arch, mt in SUPPORTED_ARCHITECTURES.items()}

_SAMPLE_WINDOW = 64 * 1024
_SAMPLE_POINTS = 5


class TensorSource(Protocol):
    """What a format-specific loader provides to :class:`Checkpoint`."""

    def tensor_names(self) -> list[str]: ...

    def iter_tensors(
        self, names: Collection[str] | None = None, timings: dict[str, float] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]: ...

    def fingerprint_parts(self) -> Iterator[bytes]: ...

    def files(self) -> list[Path]: ...


@dataclass(frozen=True)
class TensorLocation:
    """Where one tensor's raw bytes lie in a checkpoint file (formats that store plain tensors)."""

    name: str
    path: Path
    offset: int
    nbytes: int
    dtype: torch.dtype | None  # None: a type torch has no plain dtype for
    shape: tuple[int, ...]


def sample_data_digest(path: Path, data_start: int) -> bytes:
    """sha256 of a few fixed windows of ``path``'s data region (all of it when it is small)."""
    size = path.stat().st_size
    length = max(0, size - data_start)
    digest = hashlib.sha256(length.to_bytes(8, "little"))
    with path.open("rb") as fh:
        if length <= _SAMPLE_WINDOW * _SAMPLE_POINTS:
            fh.seek(data_start)
            digest.update(fh.read(length))
            return digest.digest()
        last = length - _SAMPLE_WINDOW
        for i in range(_SAMPLE_POINTS):
            fh.seek(data_start + last * i // (_SAMPLE_POINTS - 1))
            digest.update(fh.read(_SAMPLE_WINDOW))
    return digest.digest()
