"""Streaming byte ranges of files into one device buffer through large pinned chunks.

A load plan is a list of :class:`Chunk`: one contiguous range of one file (at most ``chunk_bytes``),
and the places in the destination buffer where its pieces go. Reader threads take chunks in turn,
``pread`` each into a pinned host buffer (no page faults, no per-tensor Python work; the kernel copies
straight from the page cache), optionally check its CRC32, and queue an asynchronous host-to-device
copy on their own CUDA stream; each thread owns two pinned buffers, so its next read overlaps its
last copy. A CPU destination is read into directly. ``zlib.crc32`` and ``os.preadv`` release the
GIL, so threads scale with cores.
"""

from __future__ import annotations

import os
import threading
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from tqdm.auto import tqdm

DEFAULT_CHUNK_BYTES = 32 << 20


class ChecksumMismatch(Exception):
    """A chunk's CRC32 differs from the one recorded when it was written."""

    def __init__(self, path: str, start: int, nbytes: int) -> None:
        super().__init__(f"{path}: CRC32 mismatch in bytes [{start}, {start + nbytes})")
        self.path, self.start, self.nbytes = path, start, nbytes


@dataclass(frozen=True)
class Chunk:
    """Bytes ``[start, start + nbytes)`` of ``path``; ``segments`` are (offset in chunk, length,
    destination offset) triples, and ``crc`` the expected CRC32 of the whole range (None: unchecked)."""

    path: str
    start: int
    nbytes: int
    segments: tuple[tuple[int, int, int], ...]
    crc: int | None = None


@dataclass
class StreamStats:
    seconds: float = 0.0  # wall clock of the whole stream
    bytes: int = 0
    threads: int = 0
    chunk_bytes: int = 0
    pin_seconds: float = 0.0  # page-locking the staging buffers (the slowest thread; CUDA only)
    read_busy_seconds: float = 0.0  # summed over threads (reads overlap each other and the copies)
    verify_busy_seconds: float = 0.0  # summed over threads
    copy_wait_seconds: float = 0.0  # summed time threads waited for their previous copy to finish
    extra: dict[str, Any] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 4),
            "bytes": self.bytes,
            "threads": self.threads,
            "chunk_mib": self.chunk_bytes / 2**20,
            "pin_seconds": round(self.pin_seconds, 4),
            "read_busy_seconds": round(self.read_busy_seconds, 4),
            "verify_busy_seconds": round(self.verify_busy_seconds, 4),
            "copy_wait_seconds": round(self.copy_wait_seconds, 4),
            **self.extra,
        }


def plan_chunks(
    pieces: Sequence[tuple[str, int, int, int]],
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_gap: int = 1 << 20,
) -> list[Chunk]:
    """Group (path, file offset, length, destination offset) pieces into chunks of at most
    ``chunk_bytes`` file bytes: pieces larger than a chunk are split, neighbours in the same file
    (gaps up to ``max_gap`` bytes are read and skipped) share one read."""
    chunks: list[Chunk] = []
    cur: list[tuple[int, int, int]] = []  # (file offset, length, dest)
    cur_path = ""

    def flush() -> None:
        if cur:
            start = cur[0][0]
            end = max(off + n for off, n, _ in cur)
            segments = tuple((off - start, n, dest) for off, n, dest in cur)
            chunks.append(Chunk(cur_path, start, end - start, segments))
            cur.clear()

    for path, offset, nbytes, dest in sorted(pieces, key=lambda p: (p[0], p[1])):
        for done in range(0, nbytes, chunk_bytes):
            off, n, d = offset + done, min(chunk_bytes, nbytes - done), dest + done
            if cur:
                last_end = cur[-1][0] + cur[-1][1]
                if path != cur_path or off < last_end or off - last_end > max_gap:
                    flush()
                elif off + n - cur[0][0] > chunk_bytes:
                    flush()
            cur_path = path
            cur.append((off, n, d))
    flush()
    return chunks


def stream_to_device(
    chunks: Sequence[Chunk],
    dest: torch.Tensor,
    threads: int | None = None,
    progress: bool = False,
    desc: str = "copying weights",
) -> StreamStats:
    """Copy every chunk's segments into ``dest`` (a flat uint8 tensor, on CUDA or the CPU).

    CUDA: each reader thread page-locks two chunk-sized staging buffers (in parallel with the other
    threads' first reads) and alternates between them. CPU: segments are read straight into
    ``dest`` (no staging copy); a checksummed chunk must then be a single segment.

    Raises :class:`ChecksumMismatch` (after stopping all readers) when a chunk's CRC32 differs;
    ``dest`` is then partly written.
    """
    assert dest.dtype == torch.uint8 and dest.dim() == 1
    stats = StreamStats()
    t0 = time.perf_counter()
    if not chunks:
        return stats
    cuda = dest.device.type == "cuda"
    n_threads = max(1, min(threads or default_threads(), len(chunks)))
    chunk_bytes = max(c.nbytes for c in chunks)
    stats.threads, stats.chunk_bytes = n_threads, chunk_bytes
    stats.bytes = sum(n for c in chunks for _, n, _ in c.segments)
    dest_view = None if cuda else memoryview(dest.numpy())

    fds = {path: os.open(path, os.O_RDONLY) for path in {c.path for c in chunks}}
    next_chunk = _Counter(len(chunks))
    stop = threading.Event()
    errors: list[BaseException] = []
    lock = threading.Lock()
    bar = tqdm(total=stats.bytes, unit="B", unit_scale=True, desc=desc, disable=not progress)

    def check(chunk: Chunk, data: memoryview) -> float:
        t = time.perf_counter()
        if zlib.crc32(data) != chunk.crc:
            raise ChecksumMismatch(chunk.path, chunk.start, chunk.nbytes)
        return time.perf_counter() - t

    def work_cpu() -> tuple[float, float, float]:
        assert dest_view is not None
        read_s = verify_s = 0.0
        for i in next_chunk:
            if stop.is_set():
                break
            chunk = chunks[i]
            t = time.perf_counter()
            for off, n, d in chunk.segments:
                _pread_exact(fds[chunk.path], dest_view[d : d + n], chunk.start + off, chunk.path)
            read_s += time.perf_counter() - t
            if chunk.crc is not None:
                assert len(chunk.segments) == 1 and chunk.segments[0][0] == 0
                _, n, d = chunk.segments[0]
                verify_s += check(chunk, dest_view[d : d + n])
            with lock:
                bar.update(sum(n for _, n, _ in chunk.segments))
        return read_s, verify_s, 0.0

    def work_cuda() -> tuple[float, float, float]:
        read_s = verify_s = wait_s = 0.0
        t = time.perf_counter()
        # page-locking is slow per call and per byte: each thread pins its own pair, overlapping
        staging = torch.empty(2 * chunk_bytes, dtype=torch.uint8, pin_memory=True)
        with lock:
            stats.pin_seconds = max(stats.pin_seconds, time.perf_counter() - t)
        stream = torch.cuda.Stream(dest.device)
        bufs = [staging[:chunk_bytes], staging[chunk_bytes:]]
        views = [memoryview(b.numpy()) for b in bufs]
        events: list[Any] = [None, None]
        k = 0
        for i in next_chunk:
            if stop.is_set():
                break
            chunk = chunks[i]
            if events[k] is not None:
                t = time.perf_counter()
                events[k].synchronize()
                wait_s += time.perf_counter() - t
            t = time.perf_counter()
            _pread_exact(fds[chunk.path], views[k][: chunk.nbytes], chunk.start, chunk.path)
            read_s += time.perf_counter() - t
            if chunk.crc is not None:
                verify_s += check(chunk, views[k][: chunk.nbytes])
            with torch.cuda.stream(stream):
                for off, n, d in chunk.segments:
                    dest[d : d + n].copy_(bufs[k][off : off + n], non_blocking=True)
                events[k] = torch.cuda.Event()
                events[k].record(stream)
            with lock:
                bar.update(sum(n for _, n, _ in chunk.segments))
            k ^= 1
        t = time.perf_counter()
        stream.synchronize()
        wait_s += time.perf_counter() - t
        for view in views:
            view.release()
        return read_s, verify_s, wait_s

    def work() -> None:
        try:
            read_s, verify_s, wait_s = work_cuda() if cuda else work_cpu()
        except BaseException as exc:  # noqa: BLE001 - handed to the caller below
            stop.set()
            with lock:
                errors.append(exc)
            return
        with lock:
            stats.read_busy_seconds += read_s
            stats.verify_busy_seconds += verify_s
            stats.copy_wait_seconds += wait_s

    try:
        workers = [threading.Thread(target=work, daemon=True) for _ in range(n_threads)]
        for w in workers:
            w.start()
        for w in workers:
            w.join()
    finally:
        bar.close()
        for fd in fds.values():
            os.close(fd)
        if dest_view is not None:
            dest_view.release()
    if cuda:
        torch.cuda.synchronize(dest.device)
        # give the page-locked staging memory back to the system, not to PyTorch's host cache
        empty_host_cache = getattr(getattr(torch, "accelerator", None), "empty_host_cache", None)
        if empty_host_cache is not None:
            empty_host_cache()
    if errors:
        mismatches = [e for e in errors if isinstance(e, ChecksumMismatch)]
        raise (mismatches or errors)[0]
    stats.seconds = time.perf_counter() - t0
    return stats


def default_threads() -> int:
    return max(1, min(16, os.cpu_count() or 1))


class _Counter:
    """A thread-safe iterator over range(n)."""

    def __init__(self, n: int) -> None:
        self._n = n
        self._next = 0
        self._lock = threading.Lock()

    def __iter__(self) -> Iterator[int]:
        while True:
            with self._lock:
                if self._next >= self._n:
                    return
                i = self._next
                self._next += 1
            yield i


def _pread_exact(fd: int, view: memoryview, offset: int, path: str) -> None:
    done = 0
    while done < len(view):
        n = os.preadv(fd, [view[done:]], offset + done)
        if n <= 0:
            raise OSError(f"{path}: unexpected end of file at byte {offset + done}")
        done += n


def crc32_chunks(view: memoryview, chunk_bytes: int, threads: int | None = None) -> list[int]:
    """CRC32 of each ``chunk_bytes`` piece of ``view``, computed by a pool of threads."""
    from concurrent.futures import ThreadPoolExecutor

    starts = range(0, len(view), chunk_bytes)
    with ThreadPoolExecutor(max_workers=max(1, min(threads or default_threads(), len(starts) or 1))) as ex:
        return list(ex.map(lambda s: zlib.crc32(view[s : s + chunk_bytes]), starts))
