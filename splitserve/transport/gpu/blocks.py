"""Block ids and block copies for the GPU movers (mover.py, cuda_ipc.py, nccl.py), and which
host and GPU this is; nothing here knows a transport."""

from __future__ import annotations

import socket
import threading
import time
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from splitserve.transport.errors import TransportError
from splitserve.transport.protocol import Deadline
from splitserve.wire.kv_handle import KVHandle

# A copy of blocks whose ids make one run on both sides is one cudaMemcpy (the copy engines). Any other
# pattern on one device (p2p: the exporter's memory mapped on ours) is one launch of the block-copy
# kernel (kernels/block_copy.py, our SMs reading the peer over NVLink): no temporary, one launch,
# whatever the pattern. Without triton, up to COPY_RUNS_MAX runs are a cudaMemcpy each and more go
# through torch index kernels.
KERNEL_MIN_RUNS = 2


COPY_RUNS_MAX = 16


STAGING_BYTES = 64 << 20  # the gather/scatter path moves at most this much per kernel pair


# -- identity of this host and its GPUs -------------------------------------------------------------
def host_id() -> str:
    """The kernel's boot id (one per running host; containers of a host share it), else the hostname."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip() or socket.gethostname()
    except OSError:
        return socket.gethostname()


def gpu_uuid(device: torch.device) -> str:
    """A GPU's UUID, the same in every process whatever CUDA_VISIBLE_DEVICES says; "cpu" for the CPU."""
    if device.type != "cuda":
        return "cpu"
    return str(torch.cuda.get_device_properties(device).uuid)


def local_gpu(uuid: str) -> int | None:
    """Our index of the GPU with this UUID, or None if this process cannot see it."""
    for i in range(torch.cuda.device_count() if torch.cuda.is_available() else 0):
        if gpu_uuid(torch.device("cuda", i)) == uuid:
            return i
    return None


# -- moving blocks between two row views of KV caches --------------------------------------------
def kv_rows(kv: torch.Tensor) -> torch.Tensor:
    """A contiguous KV tensor as [num_blocks, block_nbytes] bytes (a view, no copy)."""
    return kv.reshape(kv.shape[0], -1).view(torch.uint8)


def as_ids(ids: Sequence[int] | np.ndarray) -> np.ndarray:
    if isinstance(ids, np.ndarray):
        return ids.astype(np.int64, copy=False).reshape(-1)
    return np.fromiter(ids, dtype=np.int64, count=len(ids))


_HANDLE_IDS: OrderedDict[tuple[int, ...], np.ndarray] = OrderedDict()  # a handle's ids, converted once


_HANDLE_IDS_LOCK = threading.Lock()


def handle_ids(handle: KVHandle) -> np.ndarray:
    """`handle.block_ids` as an array (cached: a handle is fetched again on retries and in benches)."""
    return cached_ids(handle.block_ids)


def cached_ids(key: tuple[int, ...]) -> np.ndarray:
    """A tuple of block ids (a handle's, a lease's) as a read-only array, converted once."""
    with _HANDLE_IDS_LOCK:
        ids = _HANDLE_IDS.get(key)
        if ids is not None:
            _HANDLE_IDS.move_to_end(key)
            return ids
    ids = as_ids(key)
    ids.setflags(write=False)
    with _HANDLE_IDS_LOCK:
        _HANDLE_IDS[key] = ids
        while len(_HANDLE_IDS) > 256:
            _HANDLE_IDS.popitem(last=False)
    return ids


def check_ids(ids: np.ndarray, num_blocks: int, what: str) -> None:
    """Non-empty, distinct, in [0, num_blocks); the messages of KVChannel.check_ids."""
    if not ids.size:
        raise ValueError(f"{what} is empty")
    bad = ids.min() < 0 or ids.max() >= num_blocks
    if not bad and ids.size > 1 and not bool((np.diff(ids) == 1).all()):  # one run is distinct
        ordered = np.sort(ids)
        bad = not bool((ordered[1:] != ordered[:-1]).all())
    if bad:
        raise ValueError(f"{what} must be distinct ids in [0, {num_blocks}), got {ids[:16].tolist()}")


def paired_runs(src_ids: Sequence[int], dst_ids: Sequence[int]) -> list[tuple[int, int, int]]:
    """(src_start, dst_start, n) for each run of ids consecutive on both sides (vectorized: a
    request can have thousands of blocks)."""
    s, d = as_ids(src_ids), as_ids(dst_ids)
    if s.shape != d.shape:
        raise ValueError(f"{s.size} source blocks, {d.size} destination blocks")
    if not s.size:
        return []
    cut = np.flatnonzero((np.diff(s) != 1) | (np.diff(d) != 1)) + 1
    starts, ends = np.concatenate(([0], cut)), np.concatenate((cut, [s.size]))
    return list(zip(s[starts].tolist(), d[starts].tolist(), (ends - starts).tolist(), strict=True))


def consecutive_start(ids: Sequence[int] | np.ndarray) -> int | None:
    """The first id when `ids` are consecutive ([4, 5, 6] -> 4), else None."""
    a = as_ids(ids)
    if not a.size or (a.size > 1 and not bool((np.diff(a) == 1).all())):
        return None
    return int(a[0])


def index_tensor(ids: Sequence[int] | np.ndarray, device: torch.device) -> torch.Tensor:
    a = as_ids(ids)
    t = torch.from_numpy(a if a.flags.writeable else a.copy())
    if device.type == "cuda":  # pinned: a truly asynchronous copy (pageable would sync the stream)
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


SPIN_S = 2e-3  # a copy's wait polls without sleeping this long (a fetch's copy takes ~0.1-10 ms)


PAUSE_S = 5e-5  # then between polls


def wait_event(event: Any, deadline: Deadline, what: str) -> None:
    """Poll a CUDA event (anything with `query() -> bool`) until it has happened, or raise
    TransferTimeout at `deadline`: unlike `synchronize()`, a copy that never ends cannot hang the
    caller. Polls back to back for SPIN_S (yielding the GIL between polls; CUDA's own synchronize
    spins too), so a short copy's end is seen within microseconds, then every PAUSE_S."""
    spin_until = time.monotonic() + SPIN_S
    while not event.query():
        deadline.remaining(what)
        time.sleep(0 if time.monotonic() < spin_until else PAUSE_S)


class _IdStage(threading.local):
    """Block ids for the block-copy kernel, host to GPU without a pinned allocation per copy: each
    thread reuses one pinned host buffer and one device buffer per device. An event recorded after
    the kernel that reads them guards reuse: while that copy still runs (a copy that overran its
    fetch's deadline, say), the next copy takes new buffers rather than wait for it. The caching
    allocators keep the old ones from reuse until the work queued on them is done."""

    def __init__(self) -> None:
        self.bufs: dict[torch.device, tuple[torch.Tensor, torch.Tensor, torch.cuda.Event | None]] = {}

    def put(self, src: np.ndarray, dst: np.ndarray, device: torch.device) -> torch.Tensor:
        n = src.size
        host, dev, last = self.bufs.get(device, (None, None, None))
        busy = last is not None and not last.query()
        if host is None or dev is None or host.numel() < 2 * n or busy:
            size = max(2 * n, 8192)
            host = torch.empty(size, dtype=torch.int64).pin_memory()
            dev = torch.empty(size, dtype=torch.int64, device=device)
        words = host.numpy()
        words[:n], words[n : 2 * n] = src, dst
        out = dev[: 2 * n]
        out.copy_(host[: 2 * n], non_blocking=True)
        dev.record_stream(torch.cuda.current_stream(device))  # freed later: not reused before this
        self.bufs[device] = (host, dev, None)
        return out

    def launched(self, device: torch.device) -> None:
        host, dev, _ = self.bufs[device]
        event = torch.cuda.Event()
        event.record()
        self.bufs[device] = (host, dev, event)


_ID_STAGE = _IdStage()


_WIDE = (torch.complex128, torch.int64, torch.int32)  # bit-exact copies, wider loads per element


_WORDS = (torch.int64, torch.int32, torch.int16)  # the same for Triton (which has no complex types)


def wide(*rows: torch.Tensor, dtypes: tuple[torch.dtype, ...] = _WIDE) -> list[torch.Tensor]:
    """Byte rows viewed with the widest element size that suits them all (faster index kernels)."""
    for dtype in dtypes:
        size = dtype.itemsize
        if all(r.shape[-1] % size == 0 and r.data_ptr() % size == 0 for r in rows):
            return [r.view(dtype) for r in rows]
    return list(rows)


def _block_copy() -> Any:
    """kernels.block_copy, or None where triton cannot be imported (cached)."""
    global _BLOCK_COPY
    if _BLOCK_COPY is None:
        try:
            from splitserve.kernels import block_copy

            _BLOCK_COPY = block_copy
        except ImportError:
            _BLOCK_COPY = False
    return _BLOCK_COPY or None


_BLOCK_COPY: Any = None


def copy_blocks(
    src_rows: torch.Tensor,
    dst_rows: torch.Tensor,
    src_ids: Sequence[int],
    dst_ids: Sequence[int],
    max_runs: int | None = None,
    staging_bytes: int | None = None,
) -> str:
    """dst_rows[dst_ids] = src_rows[src_ids], enqueued on the current stream(s); -> how it was done.

    Rows are [num_blocks, block_nbytes] uint8 on any devices. One run (ids consecutive on both sides):
    one copy ("runs": cudaMemcpy, the copy engines). More, on one GPU (p2p: the exporter's memory is
    mapped on ours): one launch of the block-copy kernel ("kernel"). Without triton: up to
    `max_runs` runs a copy each; past that one index kernel when one side is a single run ("scatter" /
    "gather"), else index_select + index_copy_ through a temporary of at most `staging_bytes`
    ("gather_scatter"). Across devices (staged), the gathers run on the source's device.
    """
    max_runs = COPY_RUNS_MAX if max_runs is None else max_runs
    s_ids, d_ids = as_ids(src_ids), as_ids(dst_ids)
    if s_ids.shape != d_ids.shape:
        raise ValueError(f"{s_ids.size} source blocks, {d_ids.size} destination blocks")
    first_s, first_d = consecutive_start(s_ids), consecutive_start(d_ids)
    one_run = first_s is not None and first_d is not None
    # how many runs, counted only where it matters (not one run: at least two)
    runs_at_least = 1 if one_run else 2 if KERNEL_MIN_RUNS <= 2 else len(paired_runs(s_ids, d_ids))
    if src_rows.is_cuda and src_rows.device == dst_rows.device and runs_at_least >= KERNEL_MIN_RUNS:
        if _block_copy() is not None:
            src_w, dst_w = wide(src_rows, dst_rows, dtypes=_WORDS)
            n = s_ids.size  # both id lists in one host-to-device copy, through this thread's buffer
            ids = _ID_STAGE.put(s_ids, d_ids, dst_rows.device)
            _block_copy().copy_rows(src_w, dst_w, ids[:n], ids[n:])
            _ID_STAGE.launched(dst_rows.device)
            return "kernel"
    runs = [(first_s, first_d, s_ids.size)] if one_run else paired_runs(s_ids, d_ids)
    if len(runs) <= max_runs:
        for s, d, n in runs:
            dst_rows[d : d + n].copy_(src_rows[s : s + n], non_blocking=True)
        return "runs"
    n = len(src_ids)
    src_w, dst_w = wide(src_rows, dst_rows)
    if src_rows.device == dst_rows.device:
        first = consecutive_start(src_ids)
        if first is not None:  # one pass: scatter straight out of the source run
            dst_w.index_copy_(0, index_tensor(dst_ids, dst_rows.device), src_w[first : first + n])
            return "scatter"
        first = consecutive_start(dst_ids)
        if first is not None:  # one pass: gather straight into the destination run
            torch.index_select(src_w, 0, index_tensor(src_ids, src_rows.device), out=dst_w[first : first + n])
            return "gather"
    per = max(1, (STAGING_BYTES if staging_bytes is None else staging_bytes) // src_rows.shape[1])
    src_idx, dst_idx = index_tensor(src_ids, src_rows.device), index_tensor(dst_ids, dst_rows.device)
    for at in range(0, n, per):
        part = src_w.index_select(0, src_idx[at : at + per])
        if part.device != dst_rows.device:
            part = part.to(dst_rows.device, non_blocking=True)
        dst_w.index_copy_(0, dst_idx[at : at + per], part)
    return "gather_scatter"


def warm_copy_kernel(rows: torch.Tensor) -> None:
    """Compile the block-copy kernel for these rows before the first fetch needs it. Triton builds it at
    its first launch, ~250 ms on an H100, and the first scattered pattern (a prefix-cache hit's shared
    blocks beside fresh ones) would pay that inside a request's TTFT. Copies two blocks onto themselves
    (the same bits back), so it runs only while no request holds blocks: at the mover's start."""
    if not rows.is_cuda or rows.shape[0] < 3 or _block_copy() is None:
        return
    with torch.cuda.device(rows.device):
        copy_blocks(rows, rows, [0, 2], [0, 2])
        torch.cuda.current_stream(rows.device).synchronize()


def ids_to_wire(ids: Sequence[int]) -> bytes:
    """Block ids as little-endian int32 bytes (base64 in the frame: thousands of ids cost microseconds,
    not a JSON list's milliseconds)."""
    return as_ids(ids).astype("<i4").tobytes()


def ids_from_wire(data: bytes) -> np.ndarray:
    if len(data) % 4:
        raise TransportError(f"malformed block ids from the exporter: {len(data)} bytes")
    return np.frombuffer(data, dtype="<i4").astype(np.int64)
