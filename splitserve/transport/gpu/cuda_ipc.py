"""cuda_ipc: GPU KV between two processes of one host, copied device to device (NVLink or PCIe P2P).

The control channel is shm's (stream/shm.py): the authenticated protocol of protocol.py on a unix socket whose
path is new for each exporter, so the two ends share a host by construction. Only the payload moves
differently: the fetcher's GPU copies the blocks straight out of the exporter's KV cache. `CudaIpcLink`
is this backend's link of the GPU mover (mover.py runs the protocol, link.py says what a link does).

Life of a connection and of one fetch:
  0. start-up: both workers keep their KV on a GPU. Asking for cuda_ipc on a host without CUDA, or with
     a KV on the CPU, is `BackendUnavailable` (backends.py, `GpuMover.__init__`).
  1. handshake (layouts + shared secret), then on the connection's first fetch the fetcher asks
     CudaIpcOpen {host, pid, gpu}. The exporter answers CudaIpcShare (frames.py): a CUDA IPC handle
     of its whole KV storage (torch's `UntypedStorage._share_cuda_()`, made once; its bytes ride
     base64 in the JSON header, nothing is pickled), its GPU's UUID, host id (boot id) and
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
     fetcher -> Fetch {lease_id, timeout_s}, and at once starts copying the handle's blocks
     (`prefetch`: safe, see there) while the exporter (lease pinned) answers
     KvCuda {block_ids, blocks, checksum} + the state tensors as the frame body.
  4. fetcher: `copy_blocks` kv_src[block_ids] -> kv[into_block_ids] on a side stream of its GPU (one
     cudaMemcpy for one run of ids consecutive on both sides, else one launch of the block-copy
     kernel); two-sided, copies again if the answer names other blocks than the handle;
     synchronizes, checks its deadline, -> Done.
  5. exporter (two-sided): drops its pin on "done" (or at the deadline, or when the fetcher hangs up).

Checksums work, but on host copies: the exporter copies the blocks to the host at export and the
fetcher after the copy (slow: leave `checksum` off unless debugging).

NOTE: like shm direct, the fetcher maps the exporter's whole KV allocation, and CUDA IPC mappings are
writable; it gets the handle only after proving the shared secret. The exporter synchronizes its
current CUDA stream in `export`, so the prefill's writes are done before any fetcher reads the blocks.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import threading
import time
from collections import OrderedDict
from typing import Any, ClassVar

import numpy as np
import torch

from splitserve.transport.board import LeaseBoard
from splitserve.transport.channel import KVChannel
from splitserve.transport.client import SyncChannel
from splitserve.transport.errors import PeerRefused, TransportError
from splitserve.transport.export_requests import Export
from splitserve.transport.frames import CudaIpcOpen, CudaIpcShare, Fetch, GpuPayload, KvCuda, Select
from splitserve.transport.gpu.blocks import copy_blocks, handle_ids, host_id, kv_rows, paired_runs, wait_event
from splitserve.transport.gpu.cuda_ipc_copy import queue_copy, queue_state_copy, wait_copies
from splitserve.transport.gpu.cuda_ipc_part import read_part
from splitserve.transport.gpu.cuda_ipc_share import PeerKV, open_board, open_peer, share_kv
from splitserve.transport.gpu.link import GpuSide, QueuedCopy
from splitserve.transport.gpu.mover import GpuMover, NoClose
from splitserve.transport.gpu.state_arena import StateArena, open_arena
from splitserve.transport.layout import KVLayout
from splitserve.transport.part_sink import PartTarget
from splitserve.transport.protocol import Deadline, expect
from splitserve.transport.server import AsyncChannel, ListenSpec, UnixSocketPath
from splitserve.transport.trace import mark
from splitserve.transport.transport import ExportRequest, FetchRequest
from splitserve.wire.kv_handle import KVHandle
from splitserve.wire.transport_info import CudaIpcInfo

log = logging.getLogger(__name__)

PEERS_MAX = 64  # exporters whose KV mapping a fetcher keeps open


class CudaIpcLink:
    """The fetcher's GPU copies the blocks out of the exporter's mapped KV (the module docstring)."""

    backend = "cuda_ipc"
    open_frame = CudaIpcOpen
    payload_frame = KvCuda

    def __init__(self) -> None:
        self.socket_path = UnixSocketPath()

    def bind(self, mover: GpuSide) -> None:
        self.mover, self.port, self.device = mover, mover.port, mover.device
        options, layout = self.port.options, self.port.layout
        self._key = f"{os.getpid()}-{secrets.token_hex(8)}"
        self._share: CudaIpcShare | None = None
        self._share_lock = threading.Lock()
        self._peers: OrderedDict[str, PeerKV] = OrderedDict()  # share key -> the opened mapping
        self._peers_lock = threading.Lock()
        self.arena: StateArena | None = None  # exported state on our GPU (not with checksums: host copies)
        if layout.state_shapes and options.state_arena_rows > 0 and not options.checksum:
            self.arena = StateArena(layout, self.device, options.state_arena_rows, options.state_wire_dtype)
            self.port.leases.on_end = self._lease_ended

    def listen_spec(self) -> ListenSpec:
        return self.socket_path.listen_spec(self.port.options.socket_dir)

    # -- exporter --------------------------------------------------------------------------------
    def make_board(self) -> LeaseBoard | None:
        try:  # in the socket directory when one is configured: fetchers can see it by construction
            return LeaseBoard(directory=self.port.options.socket_dir)
        except OSError as exc:
            log.warning("cuda_ipc: no lease board (%s): every fetch will ask the exporter first", exc)
            return None

    def share(self) -> CudaIpcShare:
        with self._share_lock:
            if self._share is None:
                board, arena = self.port.leases.board, self.arena
                self._share = share_kv(self.port.kv_cache, self.mover.rows, self._key,
                                       board.share() if board is not None else None,
                                       arena.share() if arena is not None else None)  # fmt: skip
            return self._share

    def export(self, request: ExportRequest) -> KVHandle | None:
        """The state copied into a row of our GPU's state arena (a device copy per state tensor)
        rather than to the host, when there is a free row; else None: the mover's usual export."""
        row, state, num_tokens = None, request.state, request.num_tokens
        if self.arena is not None and state:
            self.mover.sync_stream()  # the prefill's writes land before we copy the state
            row = self.arena.put(state)
        if row is None:
            return None
        self.mover.sync_stream()  # the copy is done: the engine may reuse its state slot at once
        ids = self.mover.check_ids(request.block_ids, "block_ids")
        if not 0 < num_tokens <= len(ids) * self.port.layout.block_size:
            self.arena.free(row)
            raise ValueError(f"num_tokens {num_tokens} does not fit in {len(ids)} blocks")
        address = self.port.listen()
        lease = self.port.leases.grant(ids, Export(request.request_id, {}, None, state_row=row))
        self.port.stats.count("exports")
        self.port.stats.count("state_in_arena")
        return KVHandle(
            backend=self.backend, address=address, request_id=request.request_id, lease_id=lease.lease_id,
            block_ids=ids, num_tokens=num_tokens, layout_fingerprint=self.port.layout.fingerprint,
            lease_expires_at=time.time() + self.port.options.lease_s, lease_slot=lease.slot, state_row=row,
        )  # fmt: skip

    def _lease_ended(self, lease: Any) -> None:
        export = lease.payload
        if self.arena is not None and isinstance(export, Export) and export.state_row is not None:
            self.arena.free(export.state_row)

    async def serve_open(self, chan: AsyncChannel, frame: CudaIpcOpen) -> None:
        if frame.host != host_id():
            raise PeerRefused("cuda_ipc needs both workers on one host",
                              [f"host: exporter {host_id()}, fetcher {frame.host}"])  # fmt: skip
        await chan.send(self.share(), Deadline.after(self.port.options.connect_timeout_s))
        self.port.stats.count("ipc_handles_sent")

    def start_push(self, chan: AsyncChannel, block_ids: np.ndarray, request: Fetch) -> None:
        return None  # the fetcher's GPU copies: nothing to send

    # -- fetcher ---------------------------------------------------------------------------------
    def attach(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> NoClose:
        chan.send(CudaIpcOpen(host=host_id(), pid=os.getpid(), gpu=self.mover.gpu), deadline)
        try:
            share = expect(chan.recv(deadline)[0], CudaIpcShare)
        except PeerRefused as exc:
            raise PeerRefused(f"cuda_ipc exporter {handle.address} refused us", exc.mismatches) from exc
        key = share.key
        with self._peers_lock:
            peer = self._peers.get(key)
            if peer is None:
                peer = self._open(chan, share)
                self._peers[key] = peer
                while len(self._peers) > PEERS_MAX:
                    self._peers.popitem(last=False)
            self._peers.move_to_end(key)
        return NoClose(peer)

    def _open(self, chan: SyncChannel, share: CudaIpcShare) -> PeerKV:
        """Map an exporter's KV, its lease board and its state arena (once per exporter)."""
        with torch.cuda.device(self.device) if self.mover.on_cuda else contextlib.nullcontext():
            peer = open_peer(share, self.device, self.port.layout)
        peer.board = open_board(share.board, chan.address)
        if share.state is not None:
            index = peer.rows.device.index if peer.rows.is_cuda else None
            try:
                peer.state_rows = open_arena(share.state, index)
                peer.state_wire = share.state.wire_dtype
            except TransportError as exc:  # its fetches with state then fail, saying why
                log.warning("cuda_ipc: cannot map %s's state arena: %s", chan.address, exc)
        peer.layout_fingerprint = chan.peer_layout.fingerprint if chan.peer_layout else ""
        self.port.stats.count("ipc_handles_opened")
        return peer

    def read(self, handle: KVHandle, into: np.ndarray, deadline: Deadline) -> dict[str, torch.Tensor] | None:
        """The one-sided read: the blocks straight out of the exporter's mapped KV when its lease board
        says the lease is live before and after the copy (no round trip; board.py). None (ask the
        exporter): no board slot, a state not in the arena, or the board says otherwise."""
        stateful = bool(self.port.layout.state_shapes)
        if handle.lease_slot is None or (stateful and handle.state_row is None):
            return None
        # a pooled connection: its first use attaches; `alive` says the exporter still runs
        with self.port.pool.connection(handle.address, deadline) as chan:
            peer = self._mapped(chan, handle, deadline)
            state = None if peer is None else self._read_one_sided(peer, handle, into, deadline)
            return state if state is not None and chan.alive() else None

    def _mapped(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> PeerKV | None:
        """The exporter's mapping (attached on the connection's first use), if it has a board."""
        peer: PeerKV = self.mover.peer(chan, handle, deadline).value
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
        mark("f.one_sided")
        copy = self._copy(peer, ids, into)
        state: dict[str, torch.Tensor] = {}
        if handle.state_row is not None:  # behind the blocks on our side stream: its wait covers both
            state = self._pull_state(peer, handle.state_row, deadline)
        mark("f.copy_queued")
        self._wait_copies(handle.address, deadline, copy.done)
        mark("f.copied")
        if not board.live(slot, handle.lease_id):  # it ended while we read: the bytes may be stale
            self.port.stats.count("one_sided_lost")
            return None
        self.mover.gpu_counts[f"{peer.mode}_{copy.how}"] += 1
        return state

    def prefetch(self, peer: Any, handle: KVHandle, into: np.ndarray) -> QueuedCopy | None:
        """Start copying the handle's blocks before the exporter confirms the lease: if the lease is
        live when the exporter pins it, it was live all along (a lease never comes back), so the
        bytes read meanwhile are good; if not, the answer is an error and they are dropped. Saves a
        round trip of the control channel per fetch."""
        mapped: PeerKV = peer.value
        ids = handle_ids(handle)
        if ids.min() < 0 or ids.max() >= mapped.rows.shape[0]:
            return None  # let the exporter's answer say what is wrong
        return self._copy(mapped, ids, into)

    def pull(
        self, chan: SyncChannel, peer: Any, meta: GpuPayload, src_ids: np.ndarray, into: np.ndarray,
        deadline: Deadline, early: QueuedCopy | None,
    ) -> dict[str, torch.Tensor] | None:  # fmt: skip
        mapped: PeerKV = peer.value
        if src_ids.min() < 0 or src_ids.max() >= mapped.rows.shape[0]:
            raise TransportError(f"exporter named blocks outside its cache: {src_ids[:16].tolist()}")
        state = None
        if meta.state_row is not None:  # on the exporter's GPU: copied with the blocks
            state = self._pull_state(mapped, meta.state_row, deadline)
        if early is None or not np.array_equal(early.src_ids, src_ids):  # not what we guessed: copy
            # again (behind the first copy on our side stream, so its bytes land last)
            early = self._copy(mapped, src_ids, into)
        self._wait_copies(chan.address, deadline, early.done)
        self.mover.gpu_counts[f"{mapped.mode}_{early.how}"] += 1
        return state

    def _pull_state(self, mapped: PeerKV, row: int, deadline: Deadline) -> dict[str, torch.Tensor]:
        """One device copy of the exporter's arena row into a buffer on our GPU, waited for; -> the
        state tensors (views of it, or fp32 copies when it travelled in bf16)."""
        state, done = queue_state_copy(self.mover, mapped, row, self.port.layout, self.device)
        self._wait_copies("the exporter's state arena", deadline, done)
        self.port.stats.count("state_rows_read")
        return state

    def read_part(self, request: FetchRequest, select: Select, target: PartTarget) -> int:
        """Only the `select`ed heads and state channels, copied by our GPU into `target` (a rank's own
        blocks and state at another tensor-parallel size): cuda_ipc_part.py; -> the bytes written."""
        return read_part(self.mover, request, select, target)

    def _wait_copies(self, address: str, deadline: Deadline, done: Any) -> None:
        wait_copies(self.mover, self.port.stats, self.device, address, deadline, done)

    def _copy(self, mapped: PeerKV, src_ids: np.ndarray, into: np.ndarray) -> QueuedCopy:
        how, done = queue_copy(self.mover, mapped, self.mover.rows, src_ids, into)
        return QueuedCopy(src_ids, how, done)

    def describe(self) -> CudaIpcInfo:
        with self._peers_lock:
            peers = [p.describe() for p in self._peers.values()]
        p2p = None
        if self.mover.on_cuda and torch.cuda.device_count() > 1:
            index = self.device.index or 0
            p2p = {
                str(i): torch.cuda.can_device_access_peer(index, i)
                for i in range(torch.cuda.device_count())
                if i != index
            }
        board = self.port.leases.board
        return CudaIpcInfo(peers, p2p, "host copies", None if board is None else board.describe())

    def close(self) -> None:
        with self._peers_lock:
            self._peers.clear()
        self.socket_path.close()


class CudaIpcTransport(KVChannel):
    """The control channel (on a unix socket) with the GPU mover over a cuda_ipc link."""

    # NOTE: tests only: let a CPU KV through, to exercise the protocol on a machine without a GPU
    # (same-process reads). Never set in production.
    cpu_test_double: ClassVar[bool] = False

    def __init__(self, kv: torch.Tensor, layout: KVLayout, **kwargs: Any) -> None:
        super().__init__(kv, layout, GpuMover(CudaIpcLink(), kv, self.cpu_test_double), **kwargs)


__all__ = [
    "CudaIpcLink",
    "CudaIpcTransport",
    "copy_blocks",
    "handle_ids",
    "kv_rows",
    "open_peer",
    "paired_runs",
    "wait_event",
]
