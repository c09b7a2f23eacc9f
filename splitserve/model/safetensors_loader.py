"""Hugging Face model directories: ``config.json`` plus single-file or sharded safetensors weights.

Headers are validated when the directory is opened; tensor data is memory-mapped through
``safetensors.safe_open`` and materialized one tensor at a time by ``iter_tensors``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Collection, Iterator
from pathlib import Path
from typing import Any, NoReturn

import torch
from safetensors import SafetensorError, safe_open

from splitserve.model.checkpoint_format import TensorLocation, sample_data_digest
from splitserve.model.errors import ModelLoadError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_CORRUPT_HINT = "the file is corrupt or truncated; re-download or re-save the checkpoint"
_MAX_HEADER_BYTES = 100 * 1024 * 1024  # safetensors' own limit
_SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


def read_hf_config(directory: Path) -> dict[str, Any]:
    """Load ``config.json`` from an HF model directory."""
    config_path = directory / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(
            "not a Hugging Face model directory: config.json is missing",
            path=directory,
            hint="download the full model repository, or pass a .gguf file instead",
        )
    try:
        config = json.loads(config_path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ModelLoadError(f"cannot parse config.json: {exc}", path=config_path) from exc
    if not isinstance(config, dict):
        raise ModelLoadError("config.json must contain a JSON object", path=config_path)
    return config


class SafetensorsSource:
    """Lazily reads tensors from the safetensors files of one HF directory."""

    def __init__(self, directory: Path, shards: list[tuple[Path, list[str]]]) -> None:
        self.directory = directory
        self._shards = shards

    def tensor_names(self) -> list[str]:
        return [name for _, names in self._shards for name in names]

    def iter_tensors(
        self, names: Collection[str] | None = None, timings: dict[str, float] | None = None
    ) -> Iterator[tuple[str, torch.Tensor]]:
        wanted = None if names is None else set(names)
        for file, file_names in self._shards:
            selected = [n for n in file_names if wanted is None or n in wanted]
            if not selected:
                continue
            try:
                with safe_open(file, framework="pt") as handle:
                    for name in selected:
                        t = time.perf_counter()
                        tensor = handle.get_tensor(name)
                        if timings is not None:
                            timings["read"] = timings.get("read", 0.0) + time.perf_counter() - t
                        yield name, tensor
            except (SafetensorError, OSError) as exc:
                raise ModelLoadError(
                    f"cannot read safetensors data: {exc}", path=file, hint=_CORRUPT_HINT
                ) from exc

    def files(self) -> list[Path]:
        index = self.directory / INDEX_FILE
        extra = [index] if index.is_file() else []
        return [self.directory / "config.json", *extra, *(file for file, _ in self._shards)]

    def tensor_locations(self) -> list[TensorLocation]:
        """Absolute byte range, dtype and shape of every tensor (from the headers; no data is read)."""
        out = []
        for file, names in self._shards:
            header = _read_raw_header(file)
            entries = json.loads(header)
            data_start = 8 + len(header)
            for name in names:
                info = entries[name]
                dtype = _SAFETENSORS_DTYPES.get(info["dtype"])  # None: left to the per-tensor path
                begin, end = info["data_offsets"]
                shape = tuple(int(d) for d in info["shape"])
                out.append(
                    TensorLocation(name, file, data_start + int(begin), int(end) - int(begin), dtype, shape)
                )
        return out

    def fingerprint_parts(self) -> Iterator[bytes]:
        for file, names in self._shards:
            header = _read_raw_header(file)
            yield file.name.encode()
            yield "\n".join(names).encode()
            yield header
            yield sample_data_digest(file, 8 + len(header))


def open_safetensors_dir(directory: Path) -> SafetensorsSource:
    """Locate and validate the safetensors weights of ``directory``."""
    index = directory / INDEX_FILE
    single = directory / SINGLE_FILE
    if index.is_file():
        shards = _shards_from_index(index)
    elif single.is_file():
        shards = [(single, read_tensor_names(single))]
    else:
        _raise_no_weights(directory)
    return SafetensorsSource(directory, shards)


def read_tensor_names(file: Path) -> list[str]:
    """Open ``file``'s header (validating it) and return its tensor names."""
    try:
        with safe_open(file, framework="pt") as handle:
            return list(handle.keys())
    except (SafetensorError, OSError) as exc:
        raise ModelLoadError(f"invalid safetensors file: {exc}", path=file, hint=_CORRUPT_HINT) from exc


def _shards_from_index(index: Path) -> list[tuple[Path, list[str]]]:
    try:
        weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError) as exc:
        raise ModelLoadError(
            f"cannot parse the shard index ({exc!r})", path=index, hint=_CORRUPT_HINT
        ) from exc
    if not isinstance(weight_map, dict) or not weight_map:
        raise ModelLoadError("'weight_map' must be a non-empty object", path=index, hint=_CORRUPT_HINT)
    by_file: dict[str, list[str]] = {}
    for name, file_name in weight_map.items():
        by_file.setdefault(str(file_name), []).append(str(name))
    shards: list[tuple[Path, list[str]]] = []
    for file_name in sorted(by_file):
        file = index.parent / file_name
        if not file.is_file():
            raise ModelLoadError(
                f"shard listed in {INDEX_FILE} is missing",
                path=file,
                hint="the download is incomplete; fetch all model-*.safetensors files",
            )
        present = read_tensor_names(file)
        expected = set(by_file[file_name])
        missing = sorted(expected.difference(present))
        if missing:
            raise ModelLoadError(
                f"{len(missing)} tensor(s) that {INDEX_FILE} places in this shard are absent "
                f"(first: {missing[0]!r})",
                path=file,
                hint=_CORRUPT_HINT,
            )
        shards.append((file, [name for name in present if name in expected]))
    return shards


def _raise_no_weights(directory: Path) -> NoReturn:
    files = sorted(p.name for p in directory.iterdir() if p.is_file())
    bins = [f for f in files if f.endswith(".bin")]
    if bins:
        raise ModelLoadError(
            "PyTorch .bin (pickle) weights are not supported; splitserve only loads safetensors",
            path=directory / bins[0],
            hint="convert once with transformers: "
            "AutoModelForCausalLM.from_pretrained(src).save_pretrained(dst) writes model.safetensors",
        )
    ggufs = [f for f in files if f.endswith(".gguf")]
    if ggufs:
        raise ModelLoadError(
            f"no safetensors weights, but GGUF file(s) {ggufs}",
            path=directory,
            hint=f"pass the .gguf file itself, e.g. {directory / ggufs[0]}",
        )
    others = [f for f in files if f.endswith(".safetensors")]
    found = f" (found {others})" if others else ""
    raise ModelLoadError(
        f"no model weights: expected {SINGLE_FILE} or {INDEX_FILE}{found}",
        path=directory,
        hint="download the weight files of the model repository",
    )


def _read_raw_header(file: Path) -> bytes:
    """The JSON header bytes of a safetensors file (already validated by ``safe_open``)."""
    with file.open("rb") as fh:
        size = int.from_bytes(fh.read(8), "little")
        if size > _MAX_HEADER_BYTES:
            raise ModelLoadError(
                f"safetensors header too large ({size} bytes)", path=file, hint=_CORRUPT_HINT
            )
        header = fh.read(size)
    if len(header) != size:
        raise ModelLoadError("truncated safetensors header", path=file, hint=_CORRUPT_HINT)
    return header
