"""nccl: GPU KV between workers on any hosts, sent with NCCL send/recv between the two GPUs.

The control channel is tcp's (the authenticated protocol of protocol.py on `options.host:port`); each
connection gets its own two-rank NCCL process group, and the blocks go over it. `NcclLink` is this
backend's link of the GPU mover (mover.py runs the protocol, link.py says what a link does).

Life of a connection and of one fetch:
  0. start-up: both workers keep their KV on a GPU; no CUDA, no NCCL in this torch, or a KV on the
     CPU is `BackendUnavailable`.
  1. handshake (layouts + shared secret), then on the connection's first fetch the fetcher asks
     NcclOpen {gpu, host, timeout_s} (frames.py). The exporter refuses a fetcher on its own GPU (NCCL cannot
     pair a GPU with itself), starts a TCPStore on a port the OS picks and answers
     NcclRendezvous {port, prefix, gpu}; both build a `ProcessGroupNCCL` of two ranks
     (exporter 0, fetcher 1) on that store under the random prefix (the fetcher reaches the store at
     the host of the handle's address), and a one-byte warm-up send proves the pair works before
     NcclReady. The group lives as long as the connection.
  2. fetch: fetcher -> Fetch {lease_id, timeout_s, into_run}; exporter (lease pinned) ->
     KvNccl {block_ids, blocks, checksum, chunk_blocks} + the state tensors as the frame
     body, then sends the blocks in chunks of `chunk_blocks` (the last may be shorter): all blocks
     in one message when they are one run on both sides (`into_run`: the fetcher's are) or come to
     at most ONE_MESSAGE_BYTES, else about CHUNK_BYTES each. The sends are queued on the server's
     loop thread before the answer goes out (`start_push`; a worker thread then waits for them, `NcclPush`). A
     chunk whose ids are consecutive is sent straight from the cache; any other is gathered into one
     of up to STAGING_BUFS staging buffers first (gathering chunk k+1 overlaps sending chunk k;
     nccl_chunks.py).
  3. fetcher: receives each chunk straight into kv[into] when its ids there are consecutive, else into
     a staging buffer and scatters it (receives run ahead of scatters); waits for all of it within
     its deadline -> Done.
  4. exporter: drops its pin once its sends completed and "done" came (or at the deadline).

Deadlines: NCCL calls do not time out on their own; each side polls for completion (a CUDA event)
against its deadline and watches the control socket. On either, it aborts the group (ncclCommAbort)
and the connection closes; the next fetch makes a new group. The group's own watchdog timeout is set
past `max_fetch_s`, so it never fires first.

Checksums work, on host copies of the blocks (slow: leave `checksum` off unless debugging).

NOTE: the TCPStore serves the rendezvous without authentication; its keys sit under a random prefix
that only went out over the authenticated channel. Transfers on one exporter are serialized (one
NCCL operation in flight per exporter), so that groups on one GPU never wait on each other.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import socket
import threading
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from splitserve.transport.board import LeaseBoard
from splitserve.transport.channel import KVChannel
from splitserve.transport.client import SyncChannel, parse_address
from splitserve.transport.errors import PeerRefused, TransportError
from splitserve.transport.frames import Fetch, GpuPayload, KvNccl, NcclOpen, NcclReady, NcclRendezvous
from splitserve.transport.gpu.blocks import consecutive_start, host_id
from splitserve.transport.gpu.link import GpuSide, QueuedCopy
from splitserve.transport.gpu.mover import GpuMover
from splitserve.transport.gpu.nccl_chunks import queue_recvs, queue_sends
from splitserve.transport.gpu.nccl_group import (
    PairGroup,
    aborting,
    chunk_spans,
    make_group,
    nccl_version,
    sock_gone,
    wait_done,
)
from splitserve.transport.layout import KVLayout
from splitserve.transport.protocol import Deadline, expect
from splitserve.transport.server import AsyncChannel, ListenSpec
from splitserve.transport.transport import ExportRequest
from splitserve.wire.kv_handle import KVHandle
from splitserve.wire.transport_info import NcclInfo

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # blocks go in chunks of about this much (at least one block)
# A transfer up to this size is one message (one NCCL send and receive), gathered whole into one
# staging buffer where its blocks are not one run: per-message costs (c10d's calls, NCCL's launch and
# rendezvous) are paid once. Larger ones go in CHUNK_BYTES chunks (nccl_chunks.py stages them).
ONE_MESSAGE_BYTES = 1 << 30
WARMUP_BYTE = 0x5A


class NcclLink:
    """The blocks over a two-rank NCCL group per connection (the module docstring)."""

    backend = "nccl"
    open_frame = NcclOpen
    payload_frame = KvNccl

    def bind(self, mover: GpuSide) -> None:
        self.mover, self.device, self.options = mover, mover.device, mover.options
        self.chunk_blocks = max(1, CHUNK_BYTES // mover.layout.block_nbytes)
        self.send_lock = threading.Lock()  # one NCCL operation in flight per exporter
        self.send_calls: deque[float] = deque(maxlen=64)  # seconds in c10d's send calls, per transfer

    def listen_spec(self) -> ListenSpec:
        return ListenSpec("tcp", host=self.options.host, port=self.options.port)

    def make_board(self) -> LeaseBoard | None:
        return None  # every fetch asks the exporter

    def export(self, request: ExportRequest) -> KVHandle | None:
        return None  # the usual lease; the state goes as host copies

    @property
    def group_timeout_s(self) -> float:
        return self.options.max_fetch_s + 60.0

    def blocks_per_message(self, ids: np.ndarray, into_run: bool) -> int:
        """How many blocks each message carries: all of them when they are one run on both sides (no
        staging anywhere) or fit in ONE_MESSAGE_BYTES; else `chunk_blocks`."""
        n = len(ids)
        one_run = into_run and consecutive_start(ids) is not None
        if one_run or n * self.mover.layout.block_nbytes <= ONE_MESSAGE_BYTES:
            return n
        return self.chunk_blocks

    def _refuse_own_gpu(self, peer_gpu: str) -> None:
        """NCCL cannot pair a GPU with itself: refuse a peer on ours (CPU test doubles excepted)."""
        gpu = self.mover.gpu
        if peer_gpu == gpu and self.mover.on_cuda:
            both = f"gpu: exporter and fetcher both on {gpu}"
            raise PeerRefused("nccl cannot pair a GPU with itself", [both])

    # -- exporter --------------------------------------------------------------------------------
    async def serve_open(self, chan: AsyncChannel, frame: NcclOpen) -> None:
        deadline = Deadline.after(min(max(frame.timeout_s, 0.001), self.options.max_fetch_s))
        self._refuse_own_gpu(frame.gpu)
        host = self.options.host if self.options.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        store = await asyncio.to_thread(
            dist.TCPStore, host, 0, None, True, timedelta(seconds=deadline.remaining("rendezvous")), False
        )
        prefix = f"splitserve-kv/{secrets.token_hex(16)}"
        answer = NcclRendezvous(port=store.port, prefix=prefix, gpu=self.mover.gpu, host=host_id(),
                                nccl=nccl_version())  # fmt: skip
        await chan.send(answer, deadline)
        try:
            group = make_group(dist.PrefixStore(prefix, store), 0, self.device, self.group_timeout_s)
        except (RuntimeError, ValueError) as exc:
            raise TransportError(f"nccl: cannot make a process group: {exc}") from exc
        pair = chan.attached["nccl"] = PairGroup(group, store)
        await asyncio.to_thread(self._warmup_send, pair, deadline, lambda: sock_gone(chan.sock))
        expect(await chan.recv(deadline), NcclReady)
        self.mover.stats.count("nccl_groups")

    def _warmup_send(self, pair: PairGroup, deadline: Deadline, gone: Callable[[], bool]) -> None:
        with self.send_lock, self.mover.on_device(after_current=False):
            byte = torch.full((1,), WARMUP_BYTE, dtype=torch.uint8, device=self.device)
            with aborting(pair, "nccl warm-up send"):
                work = pair.group.send([byte], 1, 0)
                wait_done([work], pair, self.device, deadline, gone, "nccl warm-up")

    def start_push(self, chan: AsyncChannel, block_ids: np.ndarray, request: Fetch) -> NcclPush:
        per = self.blocks_per_message(block_ids, request.into_run)
        return NcclPush(self, chan, block_ids, per)

    def enqueue_sends(self, pair: PairGroup, ids: np.ndarray, per: int) -> list[Any]:
        """Queue the gathers and sends of every chunk; -> the works not waited for yet."""
        with self.mover.on_device(after_current=False), aborting(pair, "nccl send"):
            works, calls = queue_sends(pair.group, self.mover.rows, ids, per)
        self.send_calls.append(calls)
        return works

    def finish_sends(
        self, pair: PairGroup, works: list[Any], deadline: Deadline, gone: Callable[[], bool]
    ) -> None:
        with self.mover.on_device(after_current=False), aborting(pair, "nccl send"):
            wait_done(works, pair, self.device, deadline, gone, "nccl send")

    # -- fetcher ---------------------------------------------------------------------------------
    def attach(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> PairGroup:
        opening = NcclOpen(gpu=self.mover.gpu, host=host_id(), timeout_s=deadline.remaining("nccl open"))
        chan.send(opening, deadline)
        try:
            answer = expect(chan.recv(deadline)[0], NcclRendezvous)
        except PeerRefused as exc:
            raise PeerRefused(f"nccl exporter {handle.address} refused us", exc.mismatches) from exc
        self._refuse_own_gpu(answer.gpu)
        family, target = parse_address(handle.address)
        if family == socket.AF_UNIX:
            raise TransportError(f"nccl needs a tcp exporter address, got {handle.address}")
        try:
            store = dist.TCPStore(str(target[0]), answer.port, None, False,
                                  timedelta(seconds=deadline.remaining("rendezvous")), False)  # fmt: skip
            group = make_group(dist.PrefixStore(answer.prefix, store), 1, self.device,
                               self.group_timeout_s)  # fmt: skip
        except (RuntimeError, ValueError) as exc:
            raise TransportError(f"nccl rendezvous with {handle.address} failed: {exc}") from exc
        pair = PairGroup(group, store)
        try:
            self._warmup_recv(chan, pair, handle, deadline)
        except BaseException:
            pair.abort()  # anything else that stops the open exchange (aborting twice is harmless)
            raise
        self.mover.stats.count("nccl_groups")
        return pair

    def _warmup_recv(self, chan: SyncChannel, pair: PairGroup, handle: KVHandle, deadline: Deadline) -> None:
        """The one-byte warm-up proves the pair works; then NcclReady."""
        with aborting(pair, f"nccl warm-up with {handle.address}"), self.mover.on_device():
            byte = torch.zeros(1, dtype=torch.uint8, device=self.device)
            work = pair.group.recv([byte], 0, 0)
            wait_done([work], pair, self.device, deadline, lambda: not chan.alive(), "nccl warm-up")
            if int(byte.item()) != WARMUP_BYTE:
                raise TransportError(f"nccl warm-up from {handle.address} delivered the wrong byte")
        chan.send(NcclReady(), deadline)

    def read(self, handle: KVHandle, into: np.ndarray, deadline: Deadline) -> None:
        return None  # every fetch asks the exporter, which sends

    def prefetch(self, peer: Any, handle: KVHandle, into: np.ndarray) -> QueuedCopy | None:
        return None  # nothing arrives before the exporter answers

    def pull(
        self, chan: SyncChannel, peer: Any, meta: GpuPayload, src_ids: np.ndarray, into: np.ndarray,
        deadline: Deadline, early: QueuedCopy | None,
    ) -> None:  # fmt: skip
        if meta.state_row is not None:
            raise TransportError("nccl: the exporter named a state arena row, which we cannot read")
        pair: PairGroup = peer
        per = meta.chunk_blocks
        if per <= 0:
            raise TransportError(f"exporter announced chunks of {per} blocks")
        with aborting(pair, f"nccl recv from {chan.address}"), self.mover.on_device():
            works, staged = queue_recvs(pair.group, self.mover.rows, into, per)
            wait_done(works, pair, self.device, deadline, lambda: not chan.alive(), "nccl recv")
        self.mover.gpu_counts["chunks"] += len(chunk_spans(len(into), per))
        self.mover.gpu_counts["chunks_staged"] += staged

    def describe(self) -> NcclInfo:
        calls = sorted(self.send_calls)
        median = round(1e3 * calls[len(calls) // 2], 3) if calls else None
        return NcclInfo(nccl_version(), self.chunk_blocks, median, "host copies")

    def close(self) -> None:
        pass


class NcclPush:
    """Exporter: one fetch's sends. Fast path (GPU, no other transfer of ours in flight): the gathers
    and sends are queued on the loop thread before the answer goes out, so that they are waiting when
    the fetcher posts its receives; the send lock stays held until `finish` or `cancel`. Else
    `finish` does it all on a worker thread."""

    def __init__(self, link: NcclLink, chan: AsyncChannel, ids: np.ndarray, per: int) -> None:
        self.link, self.pair, self.ids, self.per = link, chan.attached["nccl"], ids, per
        self.chunk_blocks = per
        self.gone: Callable[[], bool] = lambda: sock_gone(chan.sock)
        self.early: list[Any] | None = None
        if link.mover.on_cuda and link.send_lock.acquire(blocking=False):
            try:
                self.early = link.enqueue_sends(self.pair, ids, per)
            except BaseException:
                link.send_lock.release()
                raise

    def cancel(self) -> None:
        if self.early is not None:
            self.pair.abort()  # sends queued that nobody will receive
            self.link.send_lock.release()

    async def finish(self, deadline: Deadline) -> None:
        if self.early is None:
            await asyncio.to_thread(self._send_all, deadline)
            return
        try:
            await asyncio.to_thread(self.link.finish_sends, self.pair, self.early, deadline, self.gone)
        finally:
            self.link.send_lock.release()

    def _send_all(self, deadline: Deadline) -> None:
        with self.link.send_lock:
            works = self.link.enqueue_sends(self.pair, self.ids, self.per)
            self.link.finish_sends(self.pair, works, deadline, self.gone)


class NcclTransport(KVChannel):
    """The control channel (tcp) with the GPU mover over an nccl link."""

    # NOTE: tests only: let a CPU KV through, to exercise the protocol on a machine without a GPU
    # (Gloo in place of NCCL). Never set in production.
    cpu_test_double: ClassVar[bool] = False

    def __init__(self, kv: torch.Tensor, layout: KVLayout, **kwargs: Any) -> None:
        super().__init__(kv, layout, GpuMover(NcclLink(), kv, self.cpu_test_double), **kwargs)


__all__ = ["NcclLink", "NcclPush", "NcclTransport", "chunk_spans", "make_group"]
