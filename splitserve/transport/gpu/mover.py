"""GpuMover: the payload mover of the GPU backends, one class over each backend's link (link.py:
cuda_ipc.py's mapping of the exporter's KV, nccl.py's two-rank NCCL group). The mover is what the
control channel (channel.py) holds and calls; the link is called where the backends differ.

Exporter: a link's open request sets up the connection (frames.py: CudaIpcOpen / NcclOpen); each fetch
then gets the link's payload frame (KvCuda / KvNccl: block ids, blocks, checksum, ...) + the state
tensors as the frame body, the link's push (nccl sends the blocks; cuda_ipc has none), and waits for the
fetcher's "done" with the lease pinned. Fetcher: the link's one-sided read when it has one, else `attach`
once per connection, then the request, the link's `prefetch` (a copy that may start before the answer),
the header and state, its `pull`, "done". The state tensors are small and travel on the control channel,
which owns the connection, the lease and the deadline (the mover sees them through its `MoverPort`,
port.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import numpy as np
import torch

from splitserve.config.kv_backends import ACROSS_SIZES
from splitserve.transport.board import LeaseBoard
from splitserve.transport.client import SyncChannel, counted_failures, fetch_frame
from splitserve.transport.errors import BackendUnavailable, CorruptTransfer, PeerRefused, TransportError
from splitserve.transport.export_requests import PayloadCall
from splitserve.transport.fault_plan import Fault
from splitserve.transport.frames import Done, Error, Frame, GpuPayload, Select, op
from splitserve.transport.gpu.blocks import (
    as_ids,
    cached_ids,
    check_ids,
    consecutive_start,
    gpu_uuid,
    ids_from_wire,
    ids_to_wire,
    kv_rows,
    warm_copy_kernel,
)
from splitserve.transport.gpu.link import GpuLink
from splitserve.transport.part_sink import PartTarget
from splitserve.transport.payload import (
    ByteStream,
    check_select,
    empty_state,
    selected_nbytes,
    snapshot_state,
    source_pieces,
    state_pieces,
)
from splitserve.transport.port import MoverPort
from splitserve.transport.protocol import Deadline, checksum, checksum_algo, expect
from splitserve.transport.server import AsyncChannel, ListenSpec
from splitserve.transport.trace import mark
from splitserve.transport.transport import ExportRequest, FetchRequest
from splitserve.wire.kv_handle import KVHandle
from splitserve.wire.transport_info import CudaIpcInfo, MoverInfo, NcclInfo

log = logging.getLogger(__name__)


class NoClose:
    """A per-connection marker whose resource the transport owns (SyncChannel closes attachments)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def close(self) -> None: ...


class GpuMover:
    """The blocks moved GPU to GPU under the control channel's leases and auth (the module docstring),
    over one backend's `link`. It keeps what every link needs: the device, a side stream, the checks,
    the counters."""

    def __init__(self, link: GpuLink, kv_cache: torch.Tensor, cpu_test_double: bool = False) -> None:
        """Checks made before the channel exists (a KV cache on the CPU is a start-up error)."""
        self.link = link
        self.backend = link.backend
        if kv_cache.device.type != "cuda" and not cpu_test_double:
            raise BackendUnavailable(
                f"{self.backend} moves KV from GPU to GPU: it needs the KV cache on a CUDA device, "
                f"and this worker's is on {kv_cache.device}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError(f"{self.backend}: the KV cache tensor must be contiguous")

    def bind(self, port: MoverPort) -> None:
        self.port, self.kv_cache, self.layout, self.options = port, port.kv_cache, port.layout, port.options
        self.stats, self.pool, self.device = port.stats, port.pool, port.kv_cache.device
        self.rows = kv_rows(self.kv_cache)
        self.gpu = gpu_uuid(self.device)
        self.gpu_counts: Counter[str] = Counter()
        self.phases: deque[tuple[float, float, float]] = deque(maxlen=64)  # fetcher: see describe()
        self.serve_phases: deque[tuple[float, float, float]] = deque(maxlen=64)  # exporter: likewise
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        warm_copy_kernel(self.rows)
        self.link.bind(self)

    # -- device helpers (the links use them too) ---------------------------------------------------
    @property
    def on_cuda(self) -> bool:
        return self.device.type == "cuda"

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
        with torch.cuda.device(self.device):
            if after_current:
                self._stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._stream):
                yield

    def sync_stream(self) -> None:
        if self.on_cuda:
            torch.cuda.current_stream(self.device).synchronize()

    def hand_over(self, exc: BaseException, done: Any) -> None:
        """A fetch fails while the copy that `done` (its CUDA event) marks may still write its
        blocks: the exception says so (`exc.pending`, see TransportError), so that the caller keeps
        the blocks from reuse until the copy has ended (`BlockPool.free_after`) while the engine goes
        on. The latest copy's event wins: copies on our side stream end in order."""
        if done is not None and getattr(exc, "pending", None) is None and not done.query():
            exc.pending = done  # type: ignore[attr-defined]
            self.stats.count("late_copies_handed_over")

    def check_ids(self, block_ids: Sequence[int], what: str) -> tuple[int, ...]:
        ids = as_ids(block_ids)  # vectorized: a request can have thousands of blocks
        check_ids(ids, self.kv_cache.shape[0], what)
        return tuple(ids.tolist())

    def check_into(self, handle: KVHandle, into_block_ids: Sequence[int]) -> np.ndarray:
        """KVChannel.check_fetch, on arrays."""
        if handle.backend != self.backend:
            diff = f"backend: ours {self.backend}, peer {handle.backend}"
            raise PeerRefused("handle is for another backend", [diff])
        into = as_ids(into_block_ids)
        check_ids(into, self.kv_cache.shape[0], "into_block_ids")
        if into.size != handle.num_blocks:
            raise ValueError(f"the handle has {handle.num_blocks} blocks, into_block_ids has {into.size}")
        return into

    # -- the mover contract (channel.py): both sides -----------------------------------------------
    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return False  # the state travels as host copies (or through cuda_ipc's arena)

    def keep_state(self, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Host copies (the engine reuses its slot at once)."""
        return snapshot_state(self.layout, state)

    def listen_spec(self) -> ListenSpec:
        return self.link.listen_spec()

    def make_board(self) -> LeaseBoard | None:
        return self.link.make_board()

    def close(self) -> None:
        self.link.close()

    # -- exporter ----------------------------------------------------------------------------------
    def export(self, request: ExportRequest) -> KVHandle:
        handle = self.link.export(request)
        if handle is not None:
            return handle
        self.sync_stream()  # the prefill's writes to these blocks land before anyone reads them
        return self.port.lease_export(request, self.check_ids(request.block_ids, "block_ids"))

    async def serve_op(self, chan: AsyncChannel, frame: Frame) -> bool | None:
        if not isinstance(frame, self.link.open_frame):
            return None  # the channel's
        try:
            await self.link.serve_open(chan, frame)
        except PeerRefused as exc:
            self.stats.error(exc)
            log.warning("kv %s exporter refused %s: %s", self.backend, chan.peer, exc)
            await chan.send(Error.of(exc), Deadline.after(self.options.connect_timeout_s))
            return False
        chan.notes.add(op(frame))
        return True

    async def send_payload(self, call: PayloadCall) -> int:
        chan, export, block_ids, fault, deadline = call.unpack()
        if op(self.link.open_frame) not in chan.notes:
            exc = TransportError(
                f"{self.backend}: fetch before {op(self.link.open_frame)} on this connection"
            )
            await chan.send(Error.of(exc), deadline)
            raise exc
        if fault is Fault.KILL:
            return 0  # hang up instead of answering: the fetcher must fail, not hang
        select = call.request.select  # a part (cuda_ipc_part.py): the fetcher reads only these
        if select is not None:
            try:
                check_select(self.layout, select)
            except TransportError as exc:
                await chan.send(Error.of(exc), deadline)
                raise
        start = time.perf_counter()
        mark("e.serve")
        ids = cached_ids(block_ids)
        if fault is Fault.CORRUPT:
            ids = np.roll(ids, -1)  # the wrong blocks in each place: the checksum must notice
        in_row = export.state_row is not None  # the state waits in the arena: the fetcher copies it
        state = ByteStream([] if in_row else state_pieces(export.state, self.layout))
        push = self.link.start_push(chan, ids, call.request)
        mark("e.queued")
        try:
            header = self.link.payload_frame(
                blocks=len(ids), checksum=export.checksum, block_ids=ids_to_wire(ids),
                state_row=export.state_row if in_row else None,
                chunk_blocks=push.chunk_blocks if push is not None else 0,
            )  # fmt: skip
            await chan.send(header, deadline, state.nbytes)
            await chan.send_stream(state, deadline)
        except BaseException:
            if push is not None:
                push.cancel()
            raise
        answered = time.perf_counter()
        mark("e.answered")
        if push is not None:
            await push.finish(deadline)
        pushed = time.perf_counter()
        mark("e.pushed")
        expect(await chan.recv(deadline), Done)
        mark("e.done")
        self.serve_phases.append((answered - start, pushed - answered, time.perf_counter() - pushed))
        if select is not None:
            return selected_nbytes(self.layout, len(ids), select)
        return len(ids) * self.layout.block_nbytes + state.nbytes

    # -- fetcher -----------------------------------------------------------------------------------
    def fetch(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        """The link's one-sided read when it has one and it succeeds, else ask the exporter."""
        handle, timeout_s = request.handle, request.timeout_s
        into = self.check_into(handle, request.into_block_ids)
        deadline = Deadline.after(timeout_s if timeout_s is not None else self.options.fetch_timeout_s)
        start = time.perf_counter()
        try:
            state = self.link.read(handle, into, deadline)
        except TransportError as exc:
            self.stats.error(exc)
            raise
        if state is None:
            return self._ask(handle, into, deadline)
        end = time.perf_counter()
        self.verify_blocks(handle, None, into, {})
        self.phases.append((0.0, 0.0, end - start))
        self.stats.fetched(len(into) * self.layout.block_nbytes, end - start, handle.address)
        self.stats.count("one_sided_fetches")
        return state if state else empty_state(self.layout)

    def _ask(self, handle: KVHandle, into: np.ndarray, deadline: Deadline) -> dict[str, torch.Tensor]:
        """The two-sided fetch: request, answer (header and state), the link's pull, "done"."""
        state = empty_state(self.layout)
        body = ByteStream(state_pieces(state, self.layout))
        start = time.perf_counter()
        with counted_failures(self.stats, handle.address):
            with self.pool.for_handle(handle, deadline) as chan:
                peer = self.peer(chan, handle, deadline)
                request = fetch_frame(handle, deadline, into_run=consecutive_start(into) is not None)
                sent = time.perf_counter()
                mark("f.request")
                chan.send(request, deadline)
                early = self.link.prefetch(peer, handle, into)
                try:
                    header, body_nbytes = chan.recv(deadline)
                    answered = time.perf_counter()
                    mark("f.answer")
                    meta = expect(header, self.link.payload_frame)
                    src_ids = self._peer_ids(meta, len(into))
                    in_row = meta.state_row is not None
                    if body_nbytes != (0 if in_row else body.nbytes):
                        raise TransportError(
                            f"exporter sends {body_nbytes} bytes of state, we expect {body.nbytes}"
                        )
                    if not in_row:
                        chan.recv_stream(body, deadline)
                    in_arena = self.link.pull(chan, peer, meta, src_ids, into, deadline, early)
                    if in_arena is not None:  # the state was in the exporter's arena
                        state = in_arena
                    pulled = time.perf_counter()
                    mark("f.pulled")
                except BaseException as exc:
                    if early is not None:  # on the way out of a failed fetch: no wait
                        self.hand_over(exc, early.done)
                    raise
                deadline.remaining("copy out of the exporter's KV")  # past it the exporter may unpin
                chan.send(Done(), deadline)
            self.verify_blocks(handle, meta.checksum, into, state)
        nbytes = len(into) * self.layout.block_nbytes + body.nbytes
        end = time.perf_counter()
        self.phases.append((sent - start, answered - sent, pulled - answered))
        self.stats.fetched(nbytes, end - start, handle.address)
        return state

    def read_part(self, request: FetchRequest, select: Select, target: PartTarget) -> int:
        """Only the `select`ed heads and state channels of the handle's payload, into `target` (a rank's
        own blocks and state at another tensor-parallel size; channel.py's `read_part`), where the link
        can (cuda_ipc copies them on the device); -> the bytes written."""
        read = getattr(self.link, "read_part", None)
        if read is None:
            raise BackendUnavailable(
                f"{self.backend} moves whole blocks only: it cannot carry KV between replicas of "
                f"different tensor_parallel_size (use {', '.join(ACROSS_SIZES)})"
            )
        return read(request, select, target)

    def peer(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> Any:
        """The link's peer on this connection: its open exchange on the connection's first use."""
        attached = chan.attached.get(self.backend)
        if attached is None:
            attached = chan.attached[self.backend] = self.link.attach(chan, handle, deadline)
        return attached

    def _peer_ids(self, meta: GpuPayload, n: int) -> np.ndarray:
        ids = ids_from_wire(meta.block_ids)
        if ids.size != n:
            raise TransportError(f"exporter names {ids.size} blocks, the handle has {n}")
        return ids

    def verify_blocks(self, handle: KVHandle, sent: str | None, into: np.ndarray, state: dict) -> None:
        """The blocks' checksum against the handle's (else the one the exporter `sent` with them)."""
        expected = handle.checksum or sent
        if not expected:
            return
        pieces = source_pieces(self.kv_cache, into) + state_pieces(state, self.layout)  # host copies
        got = checksum(checksum_algo(expected), pieces)
        if got != expected:
            where = f"{handle.request_id} from {handle.address}"
            raise CorruptTransfer(f"payload of {where}: checksum {got}, expected {expected}")
        self.stats.count("checksums_verified")

    def describe(self) -> MoverInfo:
        # medians of recent transfers, ms. Fetcher: setup (checks, connection), request -> answer,
        # pull (the rest of the copy / the receive). Exporter: answer (header and state out), push
        # (nccl: until its sends completed), then until the fetcher's "done".
        link = self.link.describe()
        return MoverInfo(
            device=str(self.device), gpu=self.gpu, copies=dict(self.gpu_counts),
            fetch_phases_ms=_medians(self.phases, ("setup", "answer", "pull")),
            serve_phases_ms=_medians(self.serve_phases, ("answer", "push", "until_done")),
            cuda_ipc=link if isinstance(link, CudaIpcInfo) else None,
            nccl=link if isinstance(link, NcclInfo) else None,
        )  # fmt: skip


def _medians(samples: deque, names: tuple[str, ...]) -> dict[str, float] | None:
    if not samples:
        return None
    cols = zip(*samples, strict=True)
    return {n: round(1e3 * float(np.median(c)), 3) for n, c in zip(names, cols, strict=True)}


__all__ = ["GpuMover", "NoClose"]
