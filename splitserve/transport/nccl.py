"""nccl: GPU KV between workers on any hosts, sent with NCCL send/recv between the two GPUs.

The control channel is tcp's (the authenticated protocol of protocol.py on `options.host:port`); each
connection gets its own two-rank NCCL process group, and the blocks go over it.

Life of a connection and of one fetch:
  0. start-up: both workers keep their KV on a GPU; no CUDA, no NCCL in this torch, or a KV on the
     CPU is `BackendUnavailable`.
  1. handshake (layouts + shared secret), then on the connection's first fetch the fetcher asks
     {"op": "nccl_open", gpu, timeout_s}. The exporter refuses a fetcher on its own GPU (NCCL cannot
     pair a GPU with itself), starts a TCPStore on a port the OS picks and answers
     {"op": "nccl_rendezvous", port, prefix, gpu}; both build a `ProcessGroupNCCL` of two ranks
     (exporter 0, fetcher 1) on that store under the random prefix (the fetcher reaches the store at
     the host of the handle's address), and a one-byte warm-up send proves the pair works before
     {"op": "nccl_ready"}. The group lives as long as the connection.
  2. fetch: fetcher -> {"op": "fetch", lease_id, timeout_s, into_run}; exporter (lease pinned) ->
     {"op": "kv_nccl", block_ids, blocks, checksum, chunk_blocks} + the state tensors as the frame
     body, then sends the blocks in chunks of `chunk_blocks` (the last may be shorter): all blocks
     in one message when they are one run on both sides (`into_run`: the fetcher's are) or come to
     at most ONE_MESSAGE_BYTES, else about CHUNK_BYTES each. The sends are queued on the server's
     loop thread before the answer goes out (`start_push`; a worker thread then waits for them). A
     chunk whose ids are consecutive is sent straight from the cache; any other is gathered into one
     of up to STAGING_BUFS staging buffers first (gathering chunk k+1 overlaps sending chunk k;
     nccl_chunks.py).
  3. fetcher: receives each chunk straight into kv[into] when its ids there are consecutive, else into
     a staging buffer and scatters it (receives run ahead of scatters); waits for all of it within
     its deadline -> {"op": "done"}.
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
from collections.abc import Callable, Mapping
from datetime import timedelta
from typing import Any, ClassVar

import numpy as np
import torch
import torch.distributed as dist

from splitserve.transport.board import LeaseBoard
from splitserve.transport.channel import KVChannel
from splitserve.transport.client import SyncChannel, parse_address
from splitserve.transport.errors import PeerRefused, TransportError
from splitserve.transport.export_requests import PayloadCall
from splitserve.transport.gpu_blocks import consecutive_start, host_id
from splitserve.transport.gpu_two_sided import GpuTwoSided
from splitserve.transport.layout import KVLayout
from splitserve.transport.nccl_chunks import queue_recvs, queue_sends
from splitserve.transport.nccl_group import (
    PairGroup,
    aborting,
    chunk_spans,
    make_group,
    nccl_version,
    sock_gone,
    wait_done,
)
from splitserve.transport.payload import snapshot_state
from splitserve.transport.port import MoverPort
from splitserve.transport.protocol import Deadline, expect
from splitserve.transport.server import AsyncChannel, ListenSpec
from splitserve.transport.transport import ExportRequest, FetchRequest
from splitserve.wire.kv_handle import KVHandle

log = logging.getLogger(__name__)

CHUNK_BYTES = 32 << 20  # blocks go in chunks of about this much (at least one block)
# A transfer up to this size is one message (one NCCL send and receive), gathered whole into one
# staging buffer where its blocks are not one run: per-message costs (c10d's calls, NCCL's launch and
# rendezvous) are paid once. Larger ones go in CHUNK_BYTES chunks (nccl_chunks.py stages them).
ONE_MESSAGE_BYTES = 1 << 30
WARMUP_BYTE = 0x5A


class NcclMover:
    """The blocks over a two-rank NCCL group per connection (the module docstring)."""

    backend = "nccl"
    open_op = "nccl_open"
    payload_op = "kv_nccl"

    def __init__(self, kv_cache: torch.Tensor, cpu_test_double: bool = False) -> None:
        self.two_sided = GpuTwoSided(self, kv_cache, cpu_test_double)  # checks the KV cache's device

    def bind(self, port: MoverPort) -> None:
        self.port, self.device = port, port.kv_cache.device
        self.two_sided.bind(port)
        layout = self.port.layout
        self.chunk_blocks = max(1, CHUNK_BYTES // layout.block_nbytes)
        self._send_lock = threading.Lock()
        self.send_calls: deque[float] = deque(maxlen=64)  # seconds in c10d's send calls, per transfer

    def listen_spec(self) -> ListenSpec:
        return ListenSpec("tcp", host=self.port.options.host, port=self.port.options.port)

    @property
    def group_timeout_s(self) -> float:
        return self.port.options.max_fetch_s + 60.0

    def blocks_per_message(self, ids: np.ndarray, into_run: bool) -> int:
        """How many blocks each message carries: all of them when they are one run on both sides (no
        staging anywhere) or fit in ONE_MESSAGE_BYTES; else `chunk_blocks`."""
        n = len(ids)
        one_run = into_run and consecutive_start(ids) is not None
        if one_run or n * self.port.layout.block_nbytes <= ONE_MESSAGE_BYTES:
            return n
        return self.chunk_blocks

    # -- the mover contract (channel.py), the shared part held in self.two_sided -------------------
    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return False  # the state travels as host copies

    def keep_state(self, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Host copies (the engine reuses its slot at once)."""
        return snapshot_state(self.port.layout, state)

    def make_board(self) -> LeaseBoard | None:
        return None  # every fetch asks the exporter

    def export(self, request: ExportRequest) -> KVHandle:
        return self.two_sided.export(request)

    async def serve_op(self, chan: AsyncChannel, header: dict) -> bool | None:
        return await self.two_sided.serve_op(chan, header)

    async def send_payload(self, call: PayloadCall) -> int:
        return await self.two_sided.send_payload(call)

    def fetch(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        return self.two_sided.fetch(request.handle, request.into_block_ids, request.timeout_s)

    def close(self) -> None:
        pass

    # -- GpuTwoSided's hooks (gpu_two_sided.GpuBackend) with nothing to do here --------------------
    def prefetch(self, peer: Any, handle: KVHandle, into: np.ndarray) -> Any:
        return None  # nothing starts before the exporter answers

    def settle(self, early: Any, exc: BaseException) -> None:
        pass

    def pull_state(self, peer: Any, row: int, deadline: Deadline) -> dict[str, torch.Tensor]:
        raise TransportError(f"{self.backend}: the exporter named a state arena row, which we cannot read")

    def _refuse_own_gpu(self, peer_gpu: str) -> None:
        """NCCL cannot pair a GPU with itself: refuse a peer on ours (CPU test doubles excepted)."""
        gpu = self.two_sided.gpu
        if peer_gpu == gpu and self.two_sided.on_cuda:
            both = f"gpu: exporter and fetcher both on {gpu}"
            raise PeerRefused("nccl cannot pair a GPU with itself", [both])

    # -- exporter --------------------------------------------------------------------------------
    async def serve_open(self, chan: AsyncChannel, header: dict) -> bool:
        asked = float(header.get("timeout_s", self.port.options.connect_timeout_s))
        deadline = Deadline.after(min(max(asked, 0.001), self.port.options.max_fetch_s))
        self._refuse_own_gpu(str(header.get("gpu")))
        host = self.port.options.host if self.port.options.host not in ("", "0.0.0.0", "::") else "127.0.0.1"
        store = await asyncio.to_thread(
            dist.TCPStore, host, 0, None, True, timedelta(seconds=deadline.remaining("rendezvous")), False
        )
        prefix = f"splitserve-kv/{secrets.token_hex(16)}"
        answer = {"op": "nccl_rendezvous", "port": store.port, "prefix": prefix, "gpu": self.two_sided.gpu,
                  "host": host_id(), "nccl": nccl_version()}  # fmt: skip
        await chan.send(answer, deadline)
        try:
            group = make_group(dist.PrefixStore(prefix, store), 0, self.device, self.group_timeout_s)
        except (RuntimeError, ValueError) as exc:
            raise TransportError(f"nccl: cannot make a process group: {exc}") from exc
        pair = chan.attached["nccl"] = PairGroup(group, store)
        await asyncio.to_thread(self._warmup_send, pair, deadline, lambda: sock_gone(chan.sock))
        expect(await chan.recv(deadline), "nccl_ready")
        chan.notes.add(self.open_op)
        self.port.stats.count("nccl_groups")
        return True

    def _warmup_send(self, pair: PairGroup, deadline: Deadline, gone: Callable[[], bool]) -> None:
        with self._send_lock, self.two_sided.on_device(after_current=False):
            byte = torch.full((1,), WARMUP_BYTE, dtype=torch.uint8, device=self.device)
            with aborting(pair, "nccl warm-up send"):
                work = pair.group.send([byte], 1, 0)
                wait_done([work], pair, self.device, deadline, gone, "nccl warm-up")

    def chunk_for(self, chan: AsyncChannel, ids: np.ndarray) -> int:
        """Blocks per message for this fetch (`blocks_per_message`)."""
        request = chan.attached.get("fetch_request")
        into_run = bool(request.value.get("into_run")) if request is not None else False
        return self.blocks_per_message(ids, into_run)

    def payload_fields(self, chan: AsyncChannel, block_ids: np.ndarray) -> dict:
        return {"chunk_blocks": self.chunk_for(chan, block_ids)}

    def start_push(self, chan: AsyncChannel, block_ids: np.ndarray) -> Any:
        """Fast path (GPU, no other transfer of ours in flight): queue the gathers and sends on the
        loop thread before the answer goes out, so that they are waiting when the fetcher posts its
        receives; the send lock stays held until `push` or `cancel_push`. Else None: `push` does it
        all on a worker thread."""
        if not self.two_sided.on_cuda or not self._send_lock.acquire(blocking=False):
            return None
        try:
            return self._enqueue_sends(chan.attached["nccl"], block_ids, self.chunk_for(chan, block_ids))
        except BaseException:
            self._send_lock.release()
            raise

    def cancel_push(self, chan: AsyncChannel, early: Any) -> None:
        if early is not None:
            chan.attached["nccl"].abort()  # sends queued that nobody will receive
            self._send_lock.release()

    async def push(self, chan: AsyncChannel, block_ids: np.ndarray, deadline: Deadline, early: Any) -> None:
        pair: PairGroup = chan.attached["nccl"]

        def gone() -> bool:
            return sock_gone(chan.sock)

        if early is not None:
            try:
                await asyncio.to_thread(self._finish_sends, pair, early, deadline, gone)
            finally:
                self._send_lock.release()
            return
        per = self.chunk_for(chan, block_ids)
        await asyncio.to_thread(self._send_blocks, pair, block_ids, per, deadline, gone)

    def _send_blocks(
        self, pair: PairGroup, ids: np.ndarray, per: int, deadline: Deadline, gone: Callable[[], bool]
    ) -> None:
        with self._send_lock:
            self._finish_sends(pair, self._enqueue_sends(pair, ids, per), deadline, gone)

    def _enqueue_sends(self, pair: PairGroup, ids: np.ndarray, per: int) -> list[Any]:
        """Queue the gathers and sends of every chunk; -> the works not waited for yet."""
        with self.two_sided.on_device(after_current=False), aborting(pair, "nccl send"):
            works, calls = queue_sends(pair.group, self.two_sided.rows, ids, per)
        self.send_calls.append(calls)
        return works

    def _finish_sends(
        self, pair: PairGroup, works: list[Any], deadline: Deadline, gone: Callable[[], bool]
    ) -> None:
        with self.two_sided.on_device(after_current=False), aborting(pair, "nccl send"):
            wait_done(works, pair, self.device, deadline, gone, "nccl send")

    # -- fetcher ---------------------------------------------------------------------------------
    def attach(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> Any:
        chan.send({"op": self.open_op, "gpu": self.two_sided.gpu, "host": host_id(),
                   "timeout_s": deadline.remaining("nccl open")}, deadline)  # fmt: skip
        try:
            answer = expect(chan.recv(deadline)[0], "nccl_rendezvous")
        except PeerRefused as exc:
            raise PeerRefused(f"nccl exporter {handle.address} refused us", exc.mismatches) from exc
        self._refuse_own_gpu(str(answer["gpu"]))
        family, target = parse_address(handle.address)
        if family == socket.AF_UNIX:
            raise TransportError(f"nccl needs a tcp exporter address, got {handle.address}")
        try:
            store = dist.TCPStore(str(target[0]), int(answer["port"]), None, False,
                                  timedelta(seconds=deadline.remaining("rendezvous")), False)  # fmt: skip
            group = make_group(dist.PrefixStore(str(answer["prefix"]), store), 1, self.device,
                               self.group_timeout_s)  # fmt: skip
        except (RuntimeError, ValueError) as exc:
            raise TransportError(f"nccl rendezvous with {handle.address} failed: {exc}") from exc
        pair = PairGroup(group, store)
        try:
            with aborting(pair, f"nccl warm-up with {handle.address}"):
                with self.two_sided.on_device():
                    byte = torch.zeros(1, dtype=torch.uint8, device=self.device)
                    work = group.recv([byte], 0, 0)
                    wait_done(
                        [work],
                        pair,
                        self.device,
                        deadline,
                        lambda: not chan.alive(),
                        "nccl warm-up",
                    )
                    if int(byte.item()) != WARMUP_BYTE:
                        raise TransportError(f"nccl warm-up from {handle.address} delivered the wrong byte")
                chan.send({"op": "nccl_ready"}, deadline)
        except BaseException:
            pair.abort()  # anything else that stops the open exchange (aborting twice is harmless)
            raise
        self.port.stats.count("nccl_groups")
        return pair

    def fetch_fields(self, into: np.ndarray) -> dict:
        return {"into_run": consecutive_start(into) is not None}

    def pull(
        self, chan: SyncChannel, peer: Any, meta: dict, src_ids: np.ndarray, into: np.ndarray,
        deadline: Deadline, early: Any,
    ) -> None:  # fmt: skip
        pair: PairGroup = peer
        per = int(meta["chunk_blocks"])
        if per <= 0:
            raise TransportError(f"exporter announced chunks of {per} blocks")
        with aborting(pair, f"nccl recv from {chan.address}"), self.two_sided.on_device():
            works, staged = queue_recvs(pair.group, self.two_sided.rows, into, per)
            wait_done(works, pair, self.device, deadline, lambda: not chan.alive(), "nccl recv")
        self.two_sided.gpu_counts["chunks"] += len(chunk_spans(len(into), per))
        self.two_sided.gpu_counts["chunks_staged"] += staged

    def describe(self) -> dict:
        out = self.two_sided.describe()
        calls = sorted(self.send_calls)
        out["nccl"] = {"version": nccl_version(), "chunk_blocks": self.chunk_blocks,
                       "send_calls_ms": round(1e3 * calls[len(calls) // 2], 3) if calls else None,
                       "checksum_on": "host copies"}  # fmt: skip
        return out


class NcclTransport(KVChannel):
    """The control channel (tcp) with the nccl mover."""

    # NOTE: tests only: let a CPU KV through, to exercise the protocol on a machine without a GPU
    # (Gloo in place of NCCL). Never set in production.
    cpu_test_double: ClassVar[bool] = False

    def __init__(self, kv: torch.Tensor, layout: KVLayout, **kwargs: Any) -> None:
        super().__init__(kv, layout, NcclMover(kv, self.cpu_test_double), **kwargs)


__all__ = ["NcclMover", "NcclTransport", "chunk_spans", "make_group"]
