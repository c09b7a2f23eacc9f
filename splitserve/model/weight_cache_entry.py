"""One weight cache entry on disk: its file format (weight_cache.py's docstring tells it), the parameter
layout it holds (`Layout`), reading and checking its preamble and footer (`read_entry`), and loading its
tensors, mapped (`map_entry`, CPU) or streamed to a device (`stream_entry`). `WeightCache`
(weight_cache.py) finds, builds, locks and evicts entries."""

from __future__ import annotations

import contextlib
import json
import mmap
import os
import struct
import zlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitserve.model.stream import (
    ChecksumMismatch,
    Chunk,
    StreamStats,
    crc32_chunks,
    stream_to_device,
)

FORMAT_VERSION = 1


# Bump when the conversion (name mapping, merging, dequantization) changes what an entry holds.
CONVERSION_REVISION = 1


MAGIC = b"SSWCACHE"


DATA_OFFSET = 4096


ALIGN = 256


SUFFIX = ".sswc"


PREAMBLE = struct.Struct("<8sIIQQI")


DTYPES: dict[str, torch.dtype] = {
    str(dt).removeprefix("torch."): dt
    for dt in (torch.float32, torch.float16, torch.bfloat16, torch.float64, torch.int64, torch.int32)
}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the data region
    nbytes: int

    def to_json(self) -> list[Any]:
        return [self.name, dtype_name(self.dtype), list(self.shape), self.offset, self.nbytes]


@dataclass(frozen=True)
class Layout:
    """Where each parameter of a model lives in one flat byte buffer."""

    tensors: tuple[TensorSpec, ...]
    data_bytes: int

    @classmethod
    def of(cls, model: nn.Module) -> Layout:
        specs, offset = [], 0
        for name, param in model.named_parameters():
            nbytes = param.numel() * param.element_size()
            specs.append(TensorSpec(name, param.dtype, tuple(param.shape), offset, nbytes))
            offset = align_up(offset + nbytes)
        return cls(tuple(specs), offset)

    def signature(self) -> list[list[Any]]:
        return [t.to_json() for t in self.tensors]

    def by_name(self) -> dict[str, TensorSpec]:
        return {t.name: t for t in self.tensors}

    def views(self, buf: torch.Tensor, base: int = 0) -> dict[str, torch.Tensor]:
        """Typed views of each parameter inside the flat uint8 tensor ``buf`` (data at ``base``)."""
        return {
            t.name: buf[base + t.offset : base + t.offset + t.nbytes].view(t.dtype).view(t.shape)
            for t in self.tensors
        }


def align_up(n: int, to: int = ALIGN) -> int:
    return (n + to - 1) // to * to


def assign_parameters(model: nn.Module, tensors: dict[str, torch.Tensor]) -> None:
    """Make each named parameter of ``model`` the given tensor (no copy)."""
    for name, tensor in tensors.items():
        module_name, _, leaf = name.rpartition(".")
        module = model.get_submodule(module_name) if module_name else model
        module._parameters[leaf] = nn.Parameter(tensor, requires_grad=False)


@dataclass(frozen=True)
class Entry:
    path: Path
    footer: dict[str, Any]
    layout: Layout

    @property
    def data_offset(self) -> int:
        return int(self.footer["data_offset"])

    @property
    def chunk_bytes(self) -> int:
        return int(self.footer["checksum"]["chunk_bytes"])

    @property
    def crcs(self) -> list[int]:
        return [int(c) for c in self.footer["checksum"]["chunks"]]

    def chunks(self, verify: bool) -> list[Chunk]:
        size, step, crcs = self.layout.data_bytes, self.chunk_bytes, self.crcs
        return [
            Chunk(str(self.path), self.data_offset + s, min(step, size - s),
                  ((0, min(step, size - s), s),), crcs[i] if verify else None)
            for i, s in enumerate(range(0, size, step))
        ]  # fmt: skip


class CorruptEntry(Exception):
    pass


def read_entry(path: Path) -> Entry:
    """Parse and sanity-check an entry's preamble and footer (no data is read)."""
    try:
        size = path.stat().st_size
        with path.open("rb") as fh:
            magic, version, _, foot_off, foot_len, foot_crc = PREAMBLE.unpack(fh.read(PREAMBLE.size))
            if magic != MAGIC or version != FORMAT_VERSION:
                raise CorruptEntry(f"bad magic or format version ({magic!r}, {version})")
            if foot_off + foot_len != size or foot_off < DATA_OFFSET:
                raise CorruptEntry(f"footer at [{foot_off}, +{foot_len}) does not end the {size}-byte file")
            fh.seek(foot_off)
            raw = fh.read(foot_len)
    except struct.error as exc:
        raise CorruptEntry(f"truncated preamble: {exc}") from exc
    if zlib.crc32(raw) != foot_crc:
        raise CorruptEntry("footer CRC32 mismatch")
    try:
        footer = json.loads(raw)
        tensors = tuple(
            TensorSpec(n, DTYPES[d], tuple(int(x) for x in s), int(o), int(b))
            for n, d, s, o, b in footer["tensors"]
        )
        layout = Layout(tensors, int(footer["data_bytes"]))
        entry = Entry(path, footer, layout)
        n_chunks = -(-layout.data_bytes // entry.chunk_bytes) if layout.data_bytes else 0
        if len(entry.crcs) != n_chunks or entry.data_offset + layout.data_bytes > int(foot_off):
            raise CorruptEntry("checksum table or data size does not match the file")
    except (ValueError, KeyError, TypeError) as exc:
        raise CorruptEntry(f"unreadable footer: {exc!r}") from exc
    return entry


VERIFIED = ".verified"  # the stamp beside an entry: the file's state when its checksums last matched
# NOTE: file times advance by the kernel's clock tick (a few ms): a stamp written less than this after
# the file's last change could miss a write in the same tick, so it is not trusted (checked again)
RACY_S = 0.1


def _file_state(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size} {st.st_mtime_ns} {st.st_ctime_ns} {st.st_ino}"


def verified_before(path: Path) -> bool:
    """Whether every chunk's CRC32 matched when the entry was last checked and the file is unchanged
    since (size, mtime, ctime and inode as the stamp has them: any write or replacement changes one)."""
    stamp = path.with_name(path.name + VERIFIED)
    try:
        st, changed = stamp.stat(), path.stat().st_ctime_ns
        return st.st_mtime_ns - changed >= RACY_S * 1e9 and stamp.read_text() == _file_state(path)
    except OSError:
        return False


def stamp_verified(path: Path) -> None:
    """Note that the entry, as it is now, has been checked (built, or its checksums matched)."""
    stamp = path.with_name(path.name + VERIFIED)
    tmp = stamp.with_name(f".{stamp.name}.{os.getpid()}.tmp")
    with contextlib.suppress(OSError):
        tmp.write_text(_file_state(path))
        os.replace(tmp, stamp)


def map_entry(entry: Entry, verify: bool, threads: int | None = None) -> dict[str, torch.Tensor]:
    """CPU: copy-on-write views of the entry's mapping (shared with every process that maps it).

    With ``verify``, every chunk's CRC32 is checked (in parallel), which also faults the pages in;
    without, the kernel is only asked to read ahead. Raises :class:`ChecksumMismatch`.
    """
    size = entry.data_offset + entry.layout.data_bytes
    with entry.path.open("rb") as fh:
        mm = mmap.mmap(fh.fileno(), size, access=mmap.ACCESS_COPY)
    data = memoryview(mm)[entry.data_offset : size]
    try:
        if verify:
            crcs = crc32_chunks(data, entry.chunk_bytes, threads)
            for i, (got, want) in enumerate(zip(crcs, entry.crcs, strict=True)):
                if got != want:
                    start = entry.data_offset + i * entry.chunk_bytes
                    raise ChecksumMismatch(str(entry.path), start, min(entry.chunk_bytes, size - start))
        elif hasattr(mmap, "MADV_WILLNEED"):
            mm.madvise(mmap.MADV_WILLNEED)
    finally:
        data.release()
    return entry.layout.views(torch.frombuffer(mm, dtype=torch.uint8), entry.data_offset)


def stream_entry(
    entry: Entry, device: torch.device, verify: bool, progress: bool, threads: int | None = None
) -> tuple[dict[str, torch.Tensor], StreamStats]:
    """Accelerator: one device buffer for all parameters, filled in pinned chunks (CRC-checked
    in flight with ``verify``); returns views of it. Raises :class:`ChecksumMismatch`."""
    dest = torch.empty(entry.layout.data_bytes, dtype=torch.uint8, device=device)
    stats = stream_to_device(entry.chunks(verify), dest, threads, progress, desc="weights from cache")
    return entry.layout.views(dest), stats
