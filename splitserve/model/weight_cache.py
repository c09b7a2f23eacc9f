"""A host-side cache of converted weights that outlives the worker process.

An entry is the model's final parameters (after HF-name mapping, q/k/v and gate/up merging, GGUF
dequantization and dtype conversion) laid out flat in one file, so a restarted or second worker on the
same host maps it (CPU: zero-copy views of the page cache) or streams it to the accelerator in large
pinned chunks, instead of re-reading and converting the checkpoint.

File format (version 1), little-endian::

    [0, 64)            preamble: b"SSWCACHE", u32 format version, u32 0, u64 footer offset,
                       u64 footer length, u32 CRC32 of the footer, zero padding
    [4096, 4096 + N)   the parameters, each at a 256-byte aligned offset (N = data_bytes)
    [4096 + N, end)    footer: UTF-8 JSON with the key, checkpoint fingerprint, dtype, architecture,
                       splitserve version, the checkpoint files' (path, size, mtime_ns), the tensor
                       table (name, dtype, shape, offset, nbytes) and one CRC32 per 32 MiB data chunk

Entries are written to a temporary file and renamed into place (readers never see a partial entry);
builders of the same entry serialize on a lock file, so a second worker waits and then maps the
first one's result. The file name holds the architecture, dtype and key; the key hashes the format
version, splitserve version, checkpoint fingerprint, dtype, architecture and parameter layout.

Validity:

* stale - the key already changes with the checkpoint's content fingerprint (headers, config and
  sampled data windows, see ``Checkpoint.fingerprint``). In addition an entry records the size and
  mtime of each checkpoint file it was built from: if a file at the same path has changed since,
  the entry is rebuilt (this catches in-place edits the sampled fingerprint would miss).
* corrupt - a bad preamble, footer CRC, size or tensor table is detected when the entry is looked
  up (cheap); with ``verify`` (the default) every data chunk's CRC32 is checked while loading, once:
  a stamp beside the entry (``.verified``) records the file's size, mtime, ctime and inode then, and
  later loads skip the CRC32s while those are unchanged. Either way a bad entry is deleted and
  rebuilt from the checkpoint, never served.

The cost of ``verify``: zlib's CRC32 runs at about 2 GB/s per core. On CPU the check is spread over
the cores and doubles as pre-faulting the mapping (pages the first forward pass would fault anyway);
on CUDA it runs in the reader threads, overlapped with the host-to-device copies. ``verify=False``
keeps only the cheap checks (truncation, header damage), not bit flips in the data. CRC32 detects
accidental damage, not tampering: the cache directory must be as trusted as the checkpoint.

Size: ``max_bytes`` bounds the directory's entries; the least recently used ones (by mtime, which a hit
refreshes, at most every 10 min) are deleted to make room, and an entry that cannot fit (or finds no free
disk space, checked with ``posix_fallocate``) is not written: the model then loads without the cache.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import importlib.metadata
import json
import logging
import mmap
import os
import shutil
import time
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from splitserve.model.checkpoint import Checkpoint, open_checkpoint
from splitserve.model.checkpoint_memo import memo_file, signature
from splitserve.model.stream import DEFAULT_CHUNK_BYTES, crc32_chunks
from splitserve.model.weight_cache_entry import (
    CONVERSION_REVISION,
    DATA_OFFSET,
    FORMAT_VERSION,
    MAGIC,
    PREAMBLE,
    SUFFIX,
    VERIFIED,
    CorruptEntry,
    Entry,
    Layout,
    assign_parameters,
    dtype_name,
    map_entry,
    read_entry,
    stamp_verified,
    stream_entry,
)
from splitserve.tempdirs import process_gone

log = logging.getLogger(__name__)

_RESERVE_FREE_BYTES = 512 << 20  # leave this much free on the cache's file system
TOUCH_S = 600.0  # a hit refreshes an entry's mtime (its place in the LRU order) at most this often

LookupStatus = Literal["hit", "miss", "stale", "corrupt"]


def default_cache_dir() -> Path:
    """$SPLITSERVE_CACHE_DIR/weights, else ~/.cache/splitserve/weights."""
    env = os.environ.get("SPLITSERVE_CACHE_DIR")
    return (Path(env) if env else Path.home() / ".cache" / "splitserve") / "weights"


def resolve_cache_dir(setting: str | os.PathLike[str] | None) -> Path | None:
    """'auto' -> the default directory; None, '', 'off', 'none', 'false', '0' -> disabled."""
    if setting is None:
        return None
    text = str(setting).strip()
    if text.lower() in ("", "off", "none", "false", "0", "disabled"):
        return None
    if text.lower() == "auto":
        return default_cache_dir()
    return Path(text).expanduser()


def splitserve_version() -> str:
    try:
        return importlib.metadata.version("splitserve")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


# -------------------------------------------------------------------------------------------- cache


@dataclass(frozen=True)
class CheckpointInfo:
    """What the cache needs to know about the checkpoint an entry is built from."""

    fingerprint: str
    architecture: str
    path: str
    format: str
    files: tuple[Path, ...]

    def sources(self) -> list[list[Any]]:
        out = []
        for f in self.files:
            st = f.stat()
            out.append([str(f), st.st_size, st.st_mtime_ns])
        return out


class WeightCache:
    def __init__(self, directory: str | os.PathLike[str], max_bytes: int | None = None, verify: bool = True):
        self.directory = Path(directory).expanduser()
        self.max_bytes = max_bytes
        self.verify = verify

    def __repr__(self) -> str:
        return f"WeightCache({str(self.directory)!r}, max_bytes={self.max_bytes}, verify={self.verify})"

    # -- naming

    @staticmethod
    def key(info: CheckpointInfo, layout: Layout) -> str:
        payload = [
            FORMAT_VERSION,
            CONVERSION_REVISION,
            splitserve_version(),
            info.fingerprint,
            info.architecture,
            layout.signature(),
        ]
        return hashlib.sha256(json.dumps(payload, separators=(",", ":")).encode()).hexdigest()

    def entry_path(self, key: str, info: CheckpointInfo, layout: Layout) -> Path:
        dtypes = sorted({dtype_name(t.dtype) for t in layout.tensors}) or ["empty"]
        return self.directory / f"{info.architecture}-{'+'.join(dtypes)}-{key[:24]}{SUFFIX}"

    # -- lookup

    def lookup(self, path: Path, key: str, info: CheckpointInfo, layout: Layout) -> tuple[Entry | None, str]:
        """(entry, "hit") or (None, "miss" | "stale: ..." | "corrupt: ...") - cheap checks only."""
        if not path.exists():
            return None, "miss"
        try:
            entry = read_entry(path)
        except (CorruptEntry, OSError) as exc:
            return None, f"corrupt: {exc}"
        footer = entry.footer
        if footer.get("key") != key or footer.get("fingerprint") != info.fingerprint:
            return None, "corrupt: key or fingerprint differs from the file name's"
        if entry.layout.signature() != layout.signature() or entry.data_offset != DATA_OFFSET:
            return None, "corrupt: tensor table differs from the model's"
        current = {p: (size, mtime) for p, size, mtime in info.sources()}
        for p, size, mtime in footer.get("sources", []):
            if p in current and current[p] != (size, mtime):
                return None, f"stale: {p} changed since the entry was built"
        return entry, "hit"

    def touch(self, entry: Entry) -> None:
        """Mark as recently used (eviction is least-recently-used by mtime, kept to `TOUCH_S`). With
        `verify`, the entry was checked (or built) on this load: its stamp says so, so that later
        loads skip the CRC32s while the file is unchanged (weight_cache_entry.py `verified_before`)."""
        with contextlib.suppress(OSError):
            if time.time() - entry.path.stat().st_mtime > TOUCH_S:  # (each touch unsettles the stamp)
                os.utime(entry.path)
            if self.verify:
                stamp_verified(entry.path)

    def remove(self, path: Path) -> None:
        for p in (path, path.with_name(path.name + VERIFIED)):
            with contextlib.suppress(FileNotFoundError):
                p.unlink()

    @contextlib.contextmanager
    def lock(self, path: Path) -> Iterator[None]:
        """Serialize builders of one entry (across processes on this host)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(path.with_name(path.name + ".lock"), os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)  # releases the lock

    # -- space

    def entries(self) -> list[tuple[Path, int, float]]:
        """(path, bytes, mtime) of every entry, least recently used first."""
        out = []
        for p in self.directory.glob(f"*{SUFFIX}"):
            with contextlib.suppress(FileNotFoundError):
                st = p.stat()
                out.append((p, st.st_size, st.st_mtime))
        return sorted(out, key=lambda e: e[2])

    def make_room(self, needed: int, keep: Path) -> str | None:
        """Evict LRU entries so that ``needed`` more bytes fit; None if they do, else the reason."""
        if self.max_bytes is not None and needed > self.max_bytes:
            return f"entry of {needed / 1e9:.2f} GB exceeds the cache limit of {self.max_bytes / 1e9:.2f} GB"
        self._remove_orphans()
        others = [e for e in self.entries() if e[0] != keep]
        total = sum(size for _, size, _ in others)

        def short() -> bool:
            over = self.max_bytes is not None and total + needed > self.max_bytes
            return over or shutil.disk_usage(self.directory).free < needed + _RESERVE_FREE_BYTES

        while others and short():
            path, size, _ = others.pop(0)
            log.info("weight cache: evicting %s (%.2f GB, least recently used)", path.name, size / 1e9)
            self.remove(path)
            self.remove(path.with_name(path.name + ".lock"))
            total -= size
        if short():
            free = shutil.disk_usage(self.directory).free
            return f"no room: {needed / 1e9:.2f} GB needed, {free / 1e9:.2f} GB free on {self.directory}"
        return None

    def _remove_orphans(self) -> None:
        """Temporary files of builders that died."""
        for p in self.directory.glob(f".*{SUFFIX}.*.tmp"):
            pid = p.name.rsplit(".", 2)[-2]
            if pid.isdigit() and process_gone(int(pid)):
                log.info("weight cache: removing %s (its builder, pid %s, is gone)", p.name, pid)
                self.remove(p)

    # -- build

    def build(
        self,
        path: Path,
        key: str,
        info: CheckpointInfo,
        layout: Layout,
        fill: Callable[[torch.Tensor], None],
        timings: dict[str, float],
        chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    ) -> Entry | None:
        """Write a new entry: ``fill`` receives the writable data region of the new file (a flat uint8
        CPU tensor in ``layout``) and must set every parameter in it. None when the entry does not
        fit (the caller then loads without the cache). ``timings["cache_write"]`` gets the checksum,
        footer and rename time."""
        self.directory.mkdir(parents=True, exist_ok=True)
        footer_estimate = 4096 + 160 * len(layout.tensors) + 12 * (layout.data_bytes // chunk_bytes + 1)
        reason = self.make_room(DATA_OFFSET + layout.data_bytes + footer_estimate, keep=path)
        if reason is not None:
            log.warning("weight cache: not caching %s: %s", info.path, reason)
            return None
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            try:
                os.posix_fallocate(fd, 0, DATA_OFFSET + layout.data_bytes)
            except OSError as exc:
                if exc.errno not in (errno.ENOSPC, errno.EDQUOT, errno.EFBIG):
                    raise
                log.warning("weight cache: not caching %s: %s", info.path, exc)
                os.close(fd)
                fd = -1
                self.remove(tmp)
                return None
            mm = mmap.mmap(
                fd, DATA_OFFSET + layout.data_bytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE
            )
            fill(torch.frombuffer(mm, dtype=torch.uint8)[DATA_OFFSET : DATA_OFFSET + layout.data_bytes])
            t = time.perf_counter()
            data = memoryview(mm)[DATA_OFFSET : DATA_OFFSET + layout.data_bytes]
            crcs = crc32_chunks(data, chunk_bytes)
            data.release()
            footer = {
                "format": "splitserve-weight-cache",
                "format_version": FORMAT_VERSION,
                "conversion_revision": CONVERSION_REVISION,
                "splitserve_version": splitserve_version(),
                "torch_version": torch.__version__,
                "key": key,
                "fingerprint": info.fingerprint,
                "architecture": info.architecture,
                "checkpoint": info.path,
                "checkpoint_format": info.format,
                "sources": info.sources(),
                "created": time.time(),
                "data_offset": DATA_OFFSET,
                "data_bytes": layout.data_bytes,
                "tensors": layout.signature(),
                "checksum": {"algorithm": "crc32", "chunk_bytes": chunk_bytes, "chunks": crcs},
            }
            raw = json.dumps(footer, separators=(",", ":")).encode()
            foot_off = DATA_OFFSET + layout.data_bytes
            os.pwrite(fd, raw, foot_off)
            os.pwrite(fd, PREAMBLE.pack(MAGIC, FORMAT_VERSION, 0, foot_off, len(raw), zlib.crc32(raw)), 0)
            os.close(fd)
            fd = -1
            os.replace(tmp, path)
            timings["cache_write"] = timings.get("cache_write", 0.0) + time.perf_counter() - t
        except BaseException:
            if fd >= 0:
                os.close(fd)
            self.remove(tmp)
            raise
        return Entry(path, footer, layout)


# ---------------------------------------------------------------------------------- opening, memoized


def open_checkpoint_memo(path: str | os.PathLike[str], directory: Path) -> Checkpoint:
    """`open_checkpoint`, remembering a GGUF file's parsed header under ``directory/checkpoints``.

    Parsing a GGUF header with gguf's reader takes seconds for a large vocabulary (SmolLM2: 2.4 s on
    a slow core), which would dominate a cached restart. The memo (HF config, fingerprint, tensor
    table) is used only while the file's path, size, mtime, ctime and inode are unchanged; any write
    to the file changes its ctime, a replaced file has a new inode. HF directories open in
    milliseconds and are not memoized.
    """
    p = Path(path).expanduser()
    if not p.is_file() or p.suffix.lower() != ".gguf":
        return open_checkpoint(p)
    p = p.resolve()
    sig = signature(p)
    version = [FORMAT_VERSION, CONVERSION_REVISION, splitserve_version()]
    memo = memo_file(p, directory)
    with contextlib.suppress(OSError, ValueError, KeyError, TypeError):
        data = json.loads(memo.read_text(encoding="utf-8"))
        if data["sig"] == sig and data["version"] == version:
            from splitserve.model.gguf_loader import GGUFSource

            source = GGUFSource.from_state(p, data["entries"])
            ckpt = Checkpoint(path=p, format="gguf", hf_config=data["hf_config"], _source=source)
            object.__setattr__(ckpt, "_fingerprint", str(data["fingerprint"]))  # see Checkpoint.fingerprint
            return ckpt
    ckpt = open_checkpoint(p)
    state = getattr(ckpt._source, "state", None)
    if state is not None:
        data = {
            "version": version,
            "sig": sig,
            "fingerprint": ckpt.fingerprint(),
            "hf_config": ckpt.hf_config,
            "entries": state(),
        }
        with contextlib.suppress(OSError, TypeError, ValueError):
            memo.parent.mkdir(parents=True, exist_ok=True)
            tmp = memo.with_name(f".{memo.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(data), encoding="utf-8")
            os.replace(tmp, memo)
    return ckpt


# the entry's own names, for the loader and tests: weight_cache_entry.py
__all__ = [
    "DATA_OFFSET",
    "SUFFIX",
    "CheckpointInfo",
    "CorruptEntry",
    "Entry",
    "Layout",
    "WeightCache",
    "assign_parameters",
    "default_cache_dir",
    "dtype_name",
    "map_entry",
    "open_checkpoint_memo",
    "read_entry",
    "resolve_cache_dir",
    "stream_entry",
]
