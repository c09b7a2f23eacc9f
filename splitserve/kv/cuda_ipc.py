"""cuda_ipc: GPU KV between two processes of one host, copied device to device (NVLink or PCIe P2P).

The control channel is shm's (shm.py): the authenticated protocol of protocol.py on a unix socket whose
path is new for each exporter, so the two ends share a host by construction. Only the payload moves
differently: the fetcher's GPU copies the blocks straight out of the exporter's KV cache.

Life of a connection and of one fetch:
  0. start-up: both workers keep their KV on a GPU. Asking for cuda_ipc on a host without CUDA, or with
     a KV on the CPU, is `BackendUnavailable` (backends.py, `GpuSocketTransport.__init__`).
  1. handshake (layouts + shared secret), then on the connection's first fetch the fetcher asks
     {"op": "cuda_ipc_open", host, pid, gpu}. The exporter answers {"op": "cuda_ipc_handle", ...}: a
     CUDA IPC handle of its whole KV storage (torch's `UntypedStorage._share_cuda_()`, made once; its
     bytes ride base64 in the JSON header, nothing is pickled), its GPU's UUID, host id (boot id) and
     the KV's offset and block size in that storage.
  2. The fetcher refuses (PeerRefused) an exporter on another host or on a GPU it cannot see, and opens
     the handle once per exporter (`UntypedStorage._new_shared_cuda`, kept until close):
        p2p     on its own GPU, when that GPU has peer access to the exporter's: our kernels and copy
                engine read the exporter's memory over NVLink / PCIe directly;
        staged  on the exporter's GPU otherwise: the driver stages each cross-device copy;
        local   exporter and fetcher are one process (CUDA cannot open its own IPC handle): the
                exporter's tensor is used directly, from a process-wide registry.
     The answer also names the exporter's lease board (board.py), which the fetcher maps read-only.
  3. one-sided fetch (the usual one: no state to carry, the handle has a board slot, the board allows
     it): the fetcher checks the lease's slot, copies (step 4), waits for the copy and checks the slot
     again; still the lease's means its blocks were not handed back before the copy ended. No message
     at all, like an RDMA READ; the release follows in the background as for any backend. A slot
     that says otherwise (ended, or faults injected) sends the fetch down the two-sided path:
     fetcher -> {"op": "fetch", lease_id, timeout_s}, and at once starts copying the handle's blocks
     (`prefetch`: safe, see there) while the exporter (lease pinned) answers
     {"op": "kv_cuda", block_ids, blocks, checksum} + the state tensors as the frame body.
  4. fetcher: `copy_blocks` kv_src[block_ids] -> kv[into_block_ids] on a side stream of its GPU (one
     cudaMemcpy for one run of ids consecutive on both sides, else one launch of the block-copy
     kernel); two-sided, copies again if the answer names other blocks than the handle;
     synchronizes, checks its deadline, -> {"op": "done"}.
  5. exporter (two-sided): drops its pin on "done" (or at the deadline, or when the fetcher hangs up).

Checksums work, but on host copies: the exporter copies the blocks to the host at export and the
fetcher after the copy (slow: leave `checksum` off unless debugging).

NOTE: like shm direct, the fetcher maps the exporter's whole KV allocation, and CUDA IPC mappings are
writable; it gets the handle only after proving the shared secret. The exporter synchronizes its
current CUDA stream in `export`, so the prefill's writes are done before any fetcher reads the blocks.
"""

from __future__ import annotations

import base64
import contextlib
import logging
import os
import secrets
import shutil
import socket
import threading
import time
import weakref
from collections import Counter, OrderedDict, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

import numpy as np
import torch

from splitserve.kv import trace
from splitserve.kv.board import BoardView, LeaseBoard
from splitserve.kv.client import SyncChannel
from splitserve.kv.errors import (
    BackendUnavailable,
    CorruptTransfer,
    PeerRefused,
    TransferTimeout,
    TransportError,
    error_to_wire,
)
from splitserve.kv.faults import Fault
from splitserve.kv.handle import KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import FreeCallback
from splitserve.kv.payload import ByteStream, empty_state, source_pieces, state_pieces
from splitserve.kv.protocol import Deadline, checksum, checksum_algo, expect
from splitserve.kv.server import AsyncChannel, Endpoint
from splitserve.kv.socket_transport import Export, SocketTransport
from splitserve.kv.state_arena import StateArena, open_arena, unpack
from splitserve.kv.transport import TransportOptions
from splitserve.tempdirs import owned_tempdir

log = logging.getLogger(__name__)

# A copy of blocks whose ids make one run on both sides is one cudaMemcpy (the copy engines). Any other
# pattern on one device (p2p: the exporter's memory mapped on ours) is one launch of the block-copy
# kernel (kernels/block_copy.py, our SMs reading the peer over NVLink): no temporary, one launch,
# whatever the pattern. Without triton, up to COPY_RUNS_MAX runs are a cudaMemcpy each and more go
# through torch index kernels.
KERNEL_MIN_RUNS = 2
COPY_RUNS_MAX = 16
STAGING_BYTES = 64 << 20  # the gather/scatter path moves at most this much per kernel pair
PEERS_MAX = 64  # exporters whose KV mapping a fetcher keeps open


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
    """Non-empty, distinct, in [0, num_blocks); the messages of SocketTransport._check_ids."""
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


def ids_to_wire(ids: Sequence[int]) -> str:
    """Block ids as base64 of little-endian int32 (thousands of ids cost microseconds, not JSON's ms)."""
    return base64.b64encode(as_ids(ids).astype("<i4").tobytes()).decode()


def ids_from_wire(text: object) -> np.ndarray:
    if not isinstance(text, str):
        raise TransportError(f"malformed block ids from the exporter: {text!r}")
    return np.frombuffer(base64.b64decode(text.encode(), validate=True), dtype="<i4").astype(np.int64)


# -- the exporter's KV as a JSON-able share; the fetcher's view of it ------------------------------
# NOTE: a process-wide fact, not configuration: KV caches this process exports, by share key, so that
# a fetcher in the same process (CUDA cannot open its own IPC handle) can read them directly.
_LOCAL: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise TransportError(f"exporter sent a malformed IPC handle field: {text!r}")
    return base64.b64decode(text.encode(), validate=True)


def share_kv(kv: torch.Tensor, rows: torch.Tensor, key: str) -> dict:
    """The exporter's half of the open exchange: its KV storage as a CUDA IPC handle (once per key).

    `rows` is `kv_rows(kv)` held by the exporter: same-process fetchers find it under `key` while it
    lives."""
    _LOCAL[key] = rows
    share: dict[str, Any] = {
        "key": key,
        "host": host_id(),
        "pid": os.getpid(),
        "gpu": gpu_uuid(kv.device),
        "kv_offset": kv.storage_offset() * kv.element_size(),
        "kv_nbytes": rows.numel(),
        "block_nbytes": rows.shape[1],
        "handle": None,
    }
    if kv.device.type == "cuda":
        try:
            (_dev, handle, size, offset, ref_counter, ref_offset, _event, _sync) = (
                kv.untyped_storage()._share_cuda_()
            )
        except RuntimeError as exc:
            raise BackendUnavailable(
                f"cuda_ipc: cannot share this KV allocation over CUDA IPC: {exc}"
            ) from exc
        share.update(handle=_b64(handle), storage_nbytes=int(size), storage_offset=int(offset),
                     ref_counter=_b64(ref_counter), ref_counter_offset=int(ref_offset))  # fmt: skip
    return share


@dataclass
class PeerKV:
    """Fetcher side: one exporter's KV cache as byte rows on some device of ours."""

    rows: torch.Tensor  # [num_blocks, block_nbytes] uint8
    mode: str  # "p2p" | "staged" | "local"
    gpu: str  # the exporter's GPU UUID
    board: BoardView | None = None  # the exporter's lease board: one-sided fetches (board.py)
    layout_fingerprint: str = ""  # the exporter's layout, from the handshake
    state_rows: torch.Tensor | None = None  # the exporter's state arena [rows, row_nbytes] (state_arena.py)
    state_wire: str = "float32"

    def describe(self) -> dict:
        return {"mode": self.mode, "gpu": self.gpu, "device": str(self.rows.device),
                "one_sided": self.board is not None}  # fmt: skip


def open_peer(share: dict, dst: torch.device, layout: KVLayout) -> PeerKV:
    """Open the exporter's share (answer of cuda_ipc_open) for copies into our KV on `dst`."""
    if share.get("host") != host_id():
        raise PeerRefused("cuda_ipc needs both workers on one host",
                          [f"host: ours {host_id()}, peer {share.get('host')}"])  # fmt: skip
    block_nbytes, kv_nbytes = int(share["block_nbytes"]), int(share["kv_nbytes"])
    if block_nbytes != layout.block_nbytes or kv_nbytes <= 0 or kv_nbytes % block_nbytes:
        raise TransportError(f"exporter shares {kv_nbytes} bytes in blocks of {block_nbytes}; "
                             f"our layout's blocks are {layout.block_nbytes} bytes")  # fmt: skip
    gpu = str(share["gpu"])
    if int(share["pid"]) == os.getpid():
        rows = _LOCAL.get(str(share["key"]))
        if rows is None:
            raise TransportError("exporter in this process no longer holds the KV it shared")
        return PeerKV(rows, "local", gpu)
    if share.get("handle") is None or dst.type != "cuda":
        raise PeerRefused("cuda_ipc moves GPU KV between GPU workers", [f"gpu: ours {dst}, peer {gpu}"])
    src_index = local_gpu(gpu)
    if src_index is None:
        raise PeerRefused(
            "cuda_ipc: the exporter's GPU is not visible to this process",
            [f"gpu: peer {gpu}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"],
        )
    assert dst.index is not None
    p2p = src_index == dst.index or torch.cuda.can_device_access_peer(dst.index, src_index)
    args = (_unb64(share["handle"]), int(share["storage_nbytes"]), int(share["storage_offset"]),
            _unb64(share["ref_counter"]), int(share["ref_counter_offset"]), b"", False)  # fmt: skip
    storage, mode = None, "p2p"
    if p2p:  # map the exporter's memory into our own GPU's address space (peer access enabled lazily)
        try:
            storage = torch.UntypedStorage._new_shared_cuda(dst.index, *args)
        except RuntimeError as exc:
            log.warning("cuda_ipc: opening %s's KV on %s failed (%s); copying across devices instead",
                        gpu, dst, exc)  # fmt: skip
    if storage is None:
        mode = "staged" if src_index != dst.index else "p2p"
        try:
            storage = torch.UntypedStorage._new_shared_cuda(src_index, *args)
        except RuntimeError as exc:
            raise TransportError(f"cuda_ipc: cannot open the exporter's KV handle: {exc}") from exc
    offset = int(share["kv_offset"])
    if offset + kv_nbytes > storage.nbytes():
        raise TransportError(f"exporter's KV ({offset}+{kv_nbytes} bytes) lies outside its shared storage")
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, offset, (kv_nbytes // block_nbytes, block_nbytes), (block_nbytes, 1))
    return PeerKV(flat, mode, gpu)


def open_board(share: object, address: str) -> BoardView | None:
    """The fetcher's map of an exporter's lease board (the `board` of its share), or None: without
    one every fetch asks first (counted as such in describe()); no error, nothing is lost."""
    if not isinstance(share, dict):
        return None
    try:
        return BoardView(str(share["path"]), int(share["slots"]))
    except (KeyError, OSError, ValueError) as exc:
        log.warning("cuda_ipc: cannot map the lease board of %s (%s): its fetches ask first", address, exc)
        return None


class _NoClose:
    """A per-connection marker whose resource the transport owns (SyncChannel closes attachments)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def close(self) -> None: ...


# -- what cuda_ipc and nccl share ------------------------------------------------------------------
class GpuSocketTransport(SocketTransport):
    """The control channel, leases and auth of tcp/shm, with the blocks moved GPU to GPU.

    Exporter: a backend's open request sets up the connection ("cuda_ipc_open" / "nccl_open"); each
    fetch then gets {"op": payload_op, block_ids (base64 int32), blocks, checksum, ...} + the state
    tensors as the frame body, the backend's `push`, and waits for the fetcher's "done" with the
    lease pinned. Fetcher: `attach` once per connection, then the request, the backend's `prefetch`
    (work that may start before the answer), the header and state, its `pull`, "done". The state
    tensors are small and travel on the control channel.
    """

    open_op: ClassVar[str]
    payload_op: ClassVar[str]
    # NOTE: tests only: let a CPU KV through, to exercise the protocol on a machine without a GPU
    # (cuda_ipc: same-process reads; nccl: Gloo in place of NCCL). Never set in production.
    cpu_test_double: ClassVar[bool] = False

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        *,
        secret: bytes | str | None = None,
        on_free: FreeCallback | None = None,
        options: TransportOptions | None = None,
    ) -> None:
        if kv.device.type != "cuda" and not self.cpu_test_double:
            raise BackendUnavailable(
                f"{self.backend} moves KV from GPU to GPU: it needs the KV cache on a CUDA device, "
                f"and this worker's is on {kv.device}"
            )
        if not kv.is_contiguous():
            raise ValueError(f"{self.backend}: the KV tensor must be contiguous")
        super().__init__(kv, layout, secret=secret, on_free=on_free, options=options)
        self.rows = kv_rows(kv)
        self.gpu = gpu_uuid(kv.device)
        self.gpu_counts: Counter[str] = Counter()
        self.phases: deque[tuple[float, float, float]] = deque(maxlen=64)  # fetcher: see describe()
        self.serve_phases: deque[tuple[float, float, float]] = deque(maxlen=64)  # exporter: likewise
        self._stream = torch.cuda.Stream(kv.device) if kv.device.type == "cuda" else None

    # -- device helpers ----------------------------------------------------------------------------
    @property
    def on_cuda(self) -> bool:
        return self.kv.device.type == "cuda"

    @contextlib.contextmanager
    def on_device(self, after_current: bool = True) -> Iterator[None]:
        """Our GPU current, and a side stream of ours current on it, so that a transfer does not hold
        up the engine's later work on its stream. `after_current`: the transfer starts only after the
        work already queued on the caller's current stream (a fetcher: kernels still reading blocks
        that are now ours to overwrite); an exporter does not wait (`export` synchronized)."""
        if not self.on_cuda:
            yield
            return
        assert self._stream is not None
        with torch.cuda.device(self.kv.device):
            if after_current:
                self._stream.wait_stream(torch.cuda.current_stream(self.kv.device))
            with torch.cuda.stream(self._stream):
                yield

    def sync_stream(self) -> None:
        if self.on_cuda:
            torch.cuda.current_stream(self.kv.device).synchronize()

    def hand_over(self, exc: BaseException, done: Any) -> None:
        """A fetch fails while the copy that `done` (its CUDA event) marks may still write its
        blocks: the exception says so (`exc.pending`, see TransportError), so that the caller keeps
        the blocks from reuse until the copy has ended (`BlockPool.free_after`) while the engine goes
        on. The latest copy's event wins: copies on our side stream end in order."""
        if done is not None and getattr(exc, "pending", None) is None and not done.query():
            exc.pending = done  # type: ignore[attr-defined]
            self.stats.count("late_copies_handed_over")

    # -- backend hooks -----------------------------------------------------------------------------
    async def serve_open(self, chan: AsyncChannel, header: dict) -> bool:
        """Exporter: answer the backend's open request; add `open_op` to chan.notes when done."""
        raise NotImplementedError

    def payload_fields(self, chan: AsyncChannel, block_ids: np.ndarray) -> dict:
        """Exporter: extra fields of the payload header (`chan.notes`/`request_of(chan)` say more)."""
        return {}

    def fetch_fields(self, into: np.ndarray) -> dict:
        """Fetcher: extra fields of the fetch request."""
        return {}

    def prefetch(self, peer: Any, handle: KVHandle, into: np.ndarray) -> Any:
        """Fetcher: work that may start as soon as the request is out (before the exporter answers);
        -> what `pull` and `settle` get."""
        return None

    def settle(self, early: Any, exc: BaseException) -> None:
        """Fetcher: a fetch failed with `exc` after `prefetch`: say on `exc` if a copy may still
        write our blocks (`TransportError.pending`)."""

    def start_push(self, chan: AsyncChannel, block_ids: np.ndarray) -> Any:
        """Exporter, on the server loop: queue what can start before the answer goes out; -> what
        `push` (or, if the answer cannot be sent, `cancel_push`) gets."""
        return None

    def cancel_push(self, chan: AsyncChannel, early: Any) -> None:
        """Exporter: the answer did not go out after `start_push`."""

    async def push(self, chan: AsyncChannel, block_ids: np.ndarray, deadline: Deadline, early: Any) -> None:
        """Exporter: after the header and state went out, send the blocks (if the backend sends)."""

    def attach(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> Any:
        """Fetcher: the open exchange on a fresh connection; -> what `pull` needs (kept on chan)."""
        raise NotImplementedError

    def pull(
        self, chan: SyncChannel, peer: Any, meta: dict, src_ids: np.ndarray, into: np.ndarray,
        deadline: Deadline, early: Any,
    ) -> None:  # fmt: skip
        """Fetcher: move the blocks into kv[into], synchronized, within the deadline."""
        raise NotImplementedError

    def pull_state(self, peer: Any, row: int, deadline: Deadline) -> dict[str, torch.Tensor]:
        """Fetcher: the state of row `row` of the exporter's state arena (queued before `pull`, which
        waits for our side stream)."""
        raise TransportError(f"{self.backend}: the exporter named a state arena row, which we cannot read")

    def _check_ids(self, block_ids: Sequence[int], what: str) -> tuple[int, ...]:
        ids = as_ids(block_ids)  # vectorized: a request can have thousands of blocks
        check_ids(ids, self.kv.shape[0], what)
        return tuple(ids.tolist())

    def _check_into(self, handle: KVHandle, into_block_ids: Sequence[int]) -> np.ndarray:
        """SocketTransport._check_fetch, on arrays."""
        if handle.backend != self.backend:
            diff = f"backend: ours {self.backend}, peer {handle.backend}"
            raise PeerRefused("handle is for another backend", [diff])
        into = as_ids(into_block_ids)
        check_ids(into, self.kv.shape[0], "into_block_ids")
        if into.size != handle.num_blocks:
            raise ValueError(f"the handle has {handle.num_blocks} blocks, into_block_ids has {into.size}")
        return into

    # -- exporter side -----------------------------------------------------------------------------
    def export(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> KVHandle:
        self.sync_stream()  # the prefill's writes to these blocks land before anyone reads them
        return super().export(request_id, block_ids, num_tokens, state)

    async def handle(self, chan: AsyncChannel, header: dict) -> bool:
        if header["op"] == "fetch":
            chan.attached["fetch_request"] = _NoClose(header)  # what the fetcher asked, for the hooks
        if header["op"] != self.open_op:
            return await super().handle(chan, header)
        try:
            return await self.serve_open(chan, header)
        except PeerRefused as exc:
            self.stats.error(exc)
            log.warning("kv %s exporter refused %s: %s", self.backend, chan.peer, exc)
            await chan.send(error_to_wire(exc), Deadline.after(self.options.connect_timeout_s))
            return False

    async def send_payload(
        self, chan: AsyncChannel, export: Export, block_ids: tuple[int, ...], meta: dict,
        fault: Fault, deadline: Deadline,
    ) -> int:  # fmt: skip
        if self.open_op not in chan.notes:
            exc = TransportError(f"{self.backend}: fetch before {self.open_op} on this connection")
            await chan.send(error_to_wire(exc), deadline)
            raise exc
        if fault is Fault.KILL:
            return 0  # hang up instead of answering: the fetcher must fail, not hang
        start = time.perf_counter()
        trace.mark("e.serve")
        ids = cached_ids(block_ids)
        if fault is Fault.CORRUPT:
            ids = np.roll(ids, -1)  # the wrong blocks in each place: the checksum must notice
        in_row = export.state_row is not None  # the state waits in the arena: the fetcher copies it
        state = ByteStream([] if in_row else state_pieces(export.state, self.layout))
        early = self.start_push(chan, ids)
        trace.mark("e.queued")
        try:
            fields = self.payload_fields(chan, ids)
            header = {"op": self.payload_op, **meta, "block_ids": ids_to_wire(ids), **fields}
            if in_row:
                header["state_row"] = export.state_row
            await chan.send(header, deadline, state.nbytes)
            await chan.send_stream(state, deadline)
        except BaseException:
            self.cancel_push(chan, early)
            raise
        answered = time.perf_counter()
        trace.mark("e.answered")
        await self.push(chan, ids, deadline, early)
        pushed = time.perf_counter()
        trace.mark("e.pushed")
        expect(await chan.recv(deadline), "done")
        trace.mark("e.done")
        self.serve_phases.append((answered - start, pushed - answered, time.perf_counter() - pushed))
        return len(ids) * self.layout.block_nbytes + state.nbytes

    # -- fetcher side ------------------------------------------------------------------------------
    def recv_payload(self, chan: SyncChannel, stream: ByteStream, deadline: Deadline) -> dict:
        raise TransportError(f"{self.backend}: the payload is pulled by fetch(), not streamed")  # unused

    def fetch(
        self,
        handle: KVHandle,
        into_block_ids: Sequence[int],
        timeout_s: float | None = None,
        into_state: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        into = self._check_into(handle, into_block_ids)
        deadline = Deadline.after(timeout_s if timeout_s is not None else self.options.fetch_timeout_s)
        state = empty_state(self.layout)
        body = ByteStream(state_pieces(state, self.layout))
        start = time.perf_counter()
        try:
            with self.pool.connection(handle.address, deadline) as chan:
                if chan.peer_layout is not None and chan.peer_layout.fingerprint != handle.layout_fingerprint:
                    raise PeerRefused(f"handle {handle.request_id} was made for another layout")
                attached = chan.attached.get(self.backend)
                if attached is None:
                    attached = chan.attached[self.backend] = self.attach(chan, handle, deadline)
                request = {"op": "fetch", "lease_id": handle.lease_id, "request_id": handle.request_id}
                request.update(self.fetch_fields(into), timeout_s=deadline.remaining("fetch"))
                sent = time.perf_counter()
                trace.mark("f.request")
                chan.send(request, deadline)
                early = self.prefetch(attached, handle, into)
                try:
                    header, body_nbytes = chan.recv(deadline)
                    answered = time.perf_counter()
                    trace.mark("f.answer")
                    meta = expect(header, self.payload_op)
                    src_ids = self._peer_ids(meta, len(into))
                    in_row = meta.get("state_row") is not None
                    if body_nbytes != (0 if in_row else body.nbytes):
                        raise TransportError(
                            f"exporter sends {body_nbytes} bytes of state, we expect {body.nbytes}"
                        )
                    if in_row:  # on the exporter's GPU: copied with the blocks
                        state = self.pull_state(attached, int(meta["state_row"]), deadline)
                    else:
                        chan.recv_stream(body, deadline)
                    self.pull(chan, attached, meta, src_ids, into, deadline, early)
                    pulled = time.perf_counter()
                    trace.mark("f.pulled")
                except BaseException as exc:
                    self.settle(early, exc)
                    raise
                deadline.remaining("copy out of the exporter's KV")  # past it the exporter may unpin
                chan.send({"op": "done"}, deadline)
            self._verify_blocks(handle, meta, into, state)
        except TransportError as exc:
            self.stats.error(exc)
            raise
        except (KeyError, TypeError, ValueError) as exc:  # a field missing or mistyped in an answer
            malformed = TransportError(f"malformed answer from {handle.address}: {exc!r}")
            self.stats.error(malformed)
            raise malformed from exc
        nbytes = len(into) * self.layout.block_nbytes + body.nbytes
        end = time.perf_counter()
        self.phases.append((sent - start, answered - sent, pulled - answered))
        self.stats.fetched(nbytes, end - start, handle.address)
        return state

    def _peer_ids(self, meta: dict, n: int) -> np.ndarray:
        ids = ids_from_wire(meta["block_ids"])
        if ids.size != n:
            raise TransportError(f"exporter names {ids.size} blocks, the handle has {n}")
        return ids

    def _verify_blocks(self, handle: KVHandle, meta: dict, into: np.ndarray, state: dict) -> None:
        expected = handle.checksum or meta.get("checksum")
        if not expected:
            return
        pieces = source_pieces(self.kv, into) + state_pieces(state, self.layout)  # host copies
        got = checksum(checksum_algo(expected), pieces)
        if got != expected:
            where = f"{handle.request_id} from {handle.address}"
            raise CorruptTransfer(f"payload of {where}: checksum {got}, expected {expected}")
        self.stats.count("checksums_verified")

    def describe(self) -> dict:
        out = super().describe()
        out["device"] = str(self.kv.device)
        out["gpu"] = self.gpu
        out["copies"] = dict(self.gpu_counts)
        # medians of recent transfers, ms. Fetcher: setup (checks, connection), request -> answer,
        # pull (the rest of the copy / the receive). Exporter: answer (header and state out), push
        # (nccl: until its sends completed), then until the fetcher's "done".
        out["fetch_phases_ms"] = _medians(self.phases, ("setup", "answer", "pull"))
        out["serve_phases_ms"] = _medians(self.serve_phases, ("answer", "push", "until_done"))
        return out


def _medians(samples: deque, names: tuple[str, ...]) -> dict[str, float] | None:
    if not samples:
        return None
    cols = zip(*samples, strict=True)
    return {n: round(1e3 * float(np.median(c)), 3) for n, c in zip(names, cols, strict=True)}


# -- the cuda_ipc backend --------------------------------------------------------------------------
class CudaIpcTransport(GpuSocketTransport):
    backend = "cuda_ipc"
    open_op = "cuda_ipc_open"
    payload_op = "kv_cuda"
    _own_dir: str | None = None

    def __init__(self, kv: torch.Tensor, layout: KVLayout, **kwargs: Any) -> None:
        super().__init__(kv, layout, **kwargs)
        self._key = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._share: dict | None = None
        self._share_lock = threading.Lock()
        self._peers: OrderedDict[str, PeerKV] = OrderedDict()  # share key -> the opened mapping
        self._peers_lock = threading.Lock()
        self.arena: StateArena | None = None  # exported state on our GPU (not with checksums: host copies)
        rows = self.options.state_arena_rows
        if layout.state_shapes and rows > 0 and not self.options.checksum:
            self.arena = StateArena(layout, kv.device, rows, self.options.state_wire_dtype)
            self.leases.on_end = self._lease_ended

    def endpoint(self) -> Endpoint:
        if self.options.socket_dir:
            directory = self.options.socket_dir
        else:
            directory = self._own_dir = owned_tempdir("splitserve-kv-")  # swept if we are SIGKILLed
        path = os.path.join(directory, f"kv-{os.getpid()}-{secrets.token_hex(4)}.sock")
        return Endpoint("unix", path=path)

    # -- exporter --------------------------------------------------------------------------------
    def make_board(self) -> LeaseBoard | None:
        try:  # in the socket directory when one is configured: fetchers can see it by construction
            return LeaseBoard(directory=self.options.socket_dir)
        except OSError as exc:
            log.warning("cuda_ipc: no lease board (%s): every fetch will ask the exporter first", exc)
            return None

    def share(self) -> dict:
        with self._share_lock:
            if self._share is None:
                self._share = share_kv(self.kv, self.rows, self._key)
                board = self.leases.board
                self._share["board"] = board.share() if board is not None else None
                self._share["state"] = self.arena.share() if self.arena is not None else None
            return self._share

    def export(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> KVHandle:
        """As GpuSocketTransport.export, with the state copied into a row of our GPU's state arena (a
        device copy per state tensor) rather than to the host, when there is a free row."""
        row = None
        if self.arena is not None and state:
            self.sync_stream()  # the prefill's writes land before we copy the state
            row = self.arena.put(state)
        if row is None:
            return super().export(request_id, block_ids, num_tokens, state)
        self.sync_stream()  # the copy is done: the engine may reuse its state slot at once
        ids = self._check_ids(block_ids, "block_ids")
        if not 0 < num_tokens <= len(ids) * self.layout.block_size:
            self.arena.free(row)
            raise ValueError(f"num_tokens {num_tokens} does not fit in {len(ids)} blocks")
        address = self.listen()
        lease = self.leases.grant(ids, Export(request_id, {}, None, state_row=row))
        self.stats.count("exports")
        self.stats.count("state_in_arena")
        return KVHandle(
            backend=self.backend, address=address, request_id=request_id, lease_id=lease.lease_id,
            block_ids=ids, num_tokens=num_tokens, layout_fingerprint=self.layout.fingerprint,
            lease_expires_at=time.time() + self.options.lease_s, lease_slot=lease.slot, state_row=row,
        )  # fmt: skip

    def _lease_ended(self, lease: Any) -> None:
        export = lease.payload
        if self.arena is not None and isinstance(export, Export) and export.state_row is not None:
            self.arena.free(export.state_row)

    async def serve_open(self, chan: AsyncChannel, header: dict) -> bool:
        if header.get("host") != host_id():
            raise PeerRefused("cuda_ipc needs both workers on one host",
                              [f"host: exporter {host_id()}, fetcher {header.get('host')}"])  # fmt: skip
        await chan.send(
            {"op": "cuda_ipc_handle", **self.share()}, Deadline.after(self.options.connect_timeout_s)
        )
        chan.notes.add(self.open_op)
        self.stats.count("ipc_handles_sent")
        return True

    # -- fetcher ---------------------------------------------------------------------------------
    def attach(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> Any:
        hello = {"op": self.open_op, "host": host_id(), "pid": os.getpid(), "gpu": self.gpu}
        chan.send(hello, deadline)
        try:
            share = expect(chan.recv(deadline)[0], "cuda_ipc_handle")
        except PeerRefused as exc:
            raise PeerRefused(f"cuda_ipc exporter {handle.address} refused us", exc.mismatches) from exc
        key = str(share["key"])
        with self._peers_lock:
            peer = self._peers.get(key)
            if peer is None:
                with torch.cuda.device(self.kv.device) if self.on_cuda else contextlib.nullcontext():
                    peer = open_peer(share, self.kv.device, self.layout)
                peer.board = open_board(share.get("board"), chan.address)
                if share.get("state") is not None:
                    index = peer.rows.device.index if peer.rows.is_cuda else None
                    try:
                        peer.state_rows = open_arena(share["state"], index)
                        peer.state_wire = str(share["state"]["wire_dtype"])
                    except TransportError as exc:  # its fetches with state then fail, saying why
                        log.warning("cuda_ipc: cannot map %s's state arena: %s", chan.address, exc)
                peer.layout_fingerprint = chan.peer_layout.fingerprint if chan.peer_layout else ""
                self._peers[key] = peer
                self.stats.count("ipc_handles_opened")
                while len(self._peers) > PEERS_MAX:
                    self._peers.popitem(last=False)
            self._peers.move_to_end(key)
        return _NoClose(peer)

    # -- one-sided fetches -----------------------------------------------------------------------
    def fetch(
        self,
        handle: KVHandle,
        into_block_ids: Sequence[int],
        timeout_s: float | None = None,
        into_state: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Read the blocks straight out of the exporter's mapped KV when its lease board says the
        lease is live before and after the copy (no round trip; board.py); else, or for a payload
        with state, the request/answer fetch of GpuSocketTransport."""
        stateful = bool(self.layout.state_shapes)
        two_sided = handle.lease_slot is None or (stateful and handle.state_row is None)
        if two_sided or handle.backend != self.backend:
            return super().fetch(handle, into_block_ids, timeout_s)
        into = self._check_into(handle, into_block_ids)
        deadline = Deadline.after(timeout_s if timeout_s is not None else self.options.fetch_timeout_s)
        start = time.perf_counter()
        try:  # a pooled connection: its first use attaches; `alive` says the exporter still runs
            with self.pool.connection(handle.address, deadline) as chan:
                peer = self._mapped(chan, handle, deadline)
                state = None if peer is None else self._read_one_sided(peer, handle, into, deadline)
                done = state is not None and chan.alive()
        except TransportError as exc:
            self.stats.error(exc)
            raise
        if not done:  # the exporter says what became of the lease
            return super().fetch(handle, into, deadline.remaining("fetch"))
        end = time.perf_counter()
        self._verify_blocks(handle, {}, into, {})
        self.phases.append((0.0, 0.0, end - start))
        self.stats.fetched(len(into) * self.layout.block_nbytes, end - start, handle.address)
        self.stats.count("one_sided_fetches")
        return state if state else empty_state(self.layout)

    def _mapped(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> PeerKV | None:
        """The exporter's mapping (attached on the connection's first use), if it has a board."""
        attached = chan.attached.get(self.backend)
        if attached is None:
            attached = chan.attached[self.backend] = self.attach(chan, handle, deadline)
        peer: PeerKV = attached.value
        if peer.board is None or peer.layout_fingerprint != handle.layout_fingerprint:
            return None  # no board, or another layout: the exporter's answer says what is wrong
        return peer

    def _read_one_sided(
        self, peer: PeerKV, handle: KVHandle, into: np.ndarray, deadline: Deadline
    ) -> dict[str, torch.Tensor] | None:
        """-> the state read with the blocks ({} without state), or None: ask the exporter."""
        board, slot = peer.board, int(handle.lease_slot or 0)
        assert board is not None
        ids = handle_ids(handle)
        if ids.min() < 0 or ids.max() >= peer.rows.shape[0] or not board.live(slot, handle.lease_id):
            return None
        if handle.state_row is not None and peer.state_rows is None:
            return None
        trace.mark("f.one_sided")
        how, done = self._copy(peer, ids, into)
        state: dict[str, torch.Tensor] = {}
        if handle.state_row is not None:  # behind the blocks on our side stream: its wait covers both
            state = self.pull_state(_NoClose(peer), handle.state_row, deadline)
        trace.mark("f.copy_queued")
        self._wait_copies(handle.address, deadline, done)
        trace.mark("f.copied")
        if not board.live(slot, handle.lease_id):  # it ended while we read: the bytes may be stale
            self.stats.count("one_sided_lost")
            return None
        self.gpu_counts[f"{peer.mode}_{how}"] += 1
        return state

    def prefetch(self, peer: Any, handle: KVHandle, into: np.ndarray) -> Any:
        """Start copying the handle's blocks before the exporter confirms the lease: if the lease is
        live when the exporter pins it, it was live all along (a lease never comes back), so the
        bytes read meanwhile are good; if not, the answer is an error and they are dropped. Saves a
        round trip of the control channel per fetch."""
        mapped: PeerKV = peer.value
        ids = handle_ids(handle)
        if ids.min() < 0 or ids.max() >= mapped.rows.shape[0]:
            return None  # let the exporter's answer say what is wrong
        return ids, self._copy(mapped, ids, into)

    def settle(self, early: Any, exc: BaseException) -> None:
        if early is not None:  # on the way out of a failed fetch: no wait
            self.hand_over(exc, early[1][1])

    def pull(
        self, chan: SyncChannel, peer: Any, meta: dict, src_ids: np.ndarray, into: np.ndarray,
        deadline: Deadline, early: Any,
    ) -> None:  # fmt: skip
        mapped: PeerKV = peer.value
        if src_ids.min() < 0 or src_ids.max() >= mapped.rows.shape[0]:
            raise TransportError(f"exporter named blocks outside its cache: {src_ids[:16].tolist()}")
        if early is None or not np.array_equal(early[0], src_ids):  # not what we guessed: copy again
            # (behind the first copy on our side stream, so its bytes land last)
            early = src_ids, self._copy(mapped, src_ids, into)
        how, done = early[1]
        self._wait_copies(chan.address, deadline, done)
        self.gpu_counts[f"{mapped.mode}_{how}"] += 1

    def pull_state(self, peer: Any, row: int, deadline: Deadline) -> dict[str, torch.Tensor]:
        """One device copy of the exporter's arena row into a buffer on our GPU, waited for; -> the
        state tensors (views of it, or fp32 copies when it travelled in bf16)."""
        mapped: PeerKV = peer.value
        if mapped.state_rows is None:
            raise TransportError(
                "cuda_ipc: the exporter keeps the state in its GPU arena, which we could not map "
                "(see the log); set transport.state_rows: 0 to send the state the host way"
            )
        if not 0 <= row < mapped.state_rows.shape[0]:
            raise TransportError(f"exporter named state arena row {row}, outside its arena")
        try:
            with self.on_device():
                buf = torch.empty(mapped.state_rows.shape[1], dtype=torch.uint8, device=self.kv.device)
                buf.copy_(mapped.state_rows[row], non_blocking=True)
                state = unpack(buf, self.layout, mapped.state_wire)
                done = None
                if self.on_cuda:
                    done = torch.cuda.Event()
                    done.record()
        except RuntimeError as exc:  # a CUDA error
            raise TransportError(f"cuda_ipc state copy failed: {exc}") from exc
        self._wait_copies("the exporter's state arena", deadline, done)
        self.stats.count("state_rows_read")
        return state

    def _wait_copies(self, address: str, deadline: Deadline, done: Any) -> None:
        """Wait for this fetch's copies (`done`: the CUDA event after them; None: they were
        synchronous) until the fetch's deadline, polling (`wait_event`), so a copy that never ends
        cannot hang the fetch. Past the deadline: TransferTimeout carrying the copy's event
        (`pending`: the blocks stay out of use until it has happened). A CUDA error is the transfer's."""
        if done is None:
            return
        try:
            with torch.cuda.device(self.kv.device):
                wait_event(done, deadline, f"cuda_ipc copy from {address}")
        except TransferTimeout as exc:  # (a RuntimeError too: before the clause for CUDA's errors)
            self.stats.count("copy_deadline_missed")
            self.hand_over(exc, done)
            raise
        except RuntimeError as exc:
            raise TransportError(f"cuda_ipc copy from {address} failed: {exc}") from exc

    def _copy(self, mapped: PeerKV, src_ids: np.ndarray, into: np.ndarray) -> tuple[str, Any]:
        """Queue the copy on our side stream; -> (how it was done, the CUDA event after it or None)."""
        try:
            with self.on_device():
                trace.gpu_mark("f.copy_start", self.kv.device)
                how = copy_blocks(mapped.rows, self.rows, src_ids, into)
                trace.gpu_mark("f.copy_end", self.kv.device)
                if not self.on_cuda:
                    return how, None
                done = torch.cuda.Event()
                done.record()
                return how, done
        except RuntimeError as exc:  # a CUDA error
            raise TransportError(f"cuda_ipc copy failed: {exc}") from exc

    def describe(self) -> dict:
        out = super().describe()
        with self._peers_lock:
            peers = [p.describe() for p in self._peers.values()]
        p2p = None
        if self.on_cuda and torch.cuda.device_count() > 1:
            index = self.kv.device.index or 0
            p2p = {
                str(i): torch.cuda.can_device_access_peer(index, i)
                for i in range(torch.cuda.device_count())
                if i != index
            }
        board = self.leases.board
        out["cuda_ipc"] = {"peers": peers, "p2p_access": p2p, "checksum_on": "host copies",
                           "lease_board": None if board is None else board.describe()}  # fmt: skip
        return out

    def close(self) -> None:
        super().close()
        with self._peers_lock:
            self._peers.clear()
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)
