"""GpuTwoSided: the two-sided fetch the GPU movers share, a component each of them holds (cuda_ipc.py
and nccl.py: `self.two_sided`); no mover subclasses it or another mover, and neither backend imports the
other. It calls back its backend's hooks (`GpuBackend`, the contract, a Protocol).

Exporter: a backend's open request sets up the connection ("cuda_ipc_open" / "nccl_open"); each fetch
then gets {"op": payload_op, block_ids (base64 int32), blocks, checksum, ...} + the state tensors as the
frame body, the backend's `push`, and waits for the fetcher's "done" with the lease pinned. Fetcher:
`attach` once per connection, then the request, the backend's `prefetch` (work that may start before
the answer), the header and state, its `pull`, "done". The state tensors are small and travel on the
control channel (channel.py), which holds the mover and owns the connection, the lease and the deadline
(the mover sees them through its `MoverPort`, port.py).
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections import Counter, deque
from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import numpy as np
import torch

from splitserve.transport.client import SyncChannel, counted_failures, fetch_header
from splitserve.transport.errors import (
    BackendUnavailable,
    CorruptTransfer,
    PeerRefused,
    TransportError,
    error_to_wire,
)
from splitserve.transport.export_requests import PayloadCall
from splitserve.transport.fault_plan import Fault
from splitserve.transport.gpu_blocks import (
    as_ids,
    cached_ids,
    check_ids,
    gpu_uuid,
    ids_from_wire,
    ids_to_wire,
    kv_rows,
)
from splitserve.transport.payload import ByteStream, empty_state, source_pieces, state_pieces
from splitserve.transport.port import MoverPort
from splitserve.transport.protocol import Deadline, checksum, checksum_algo, expect
from splitserve.transport.server import AsyncChannel
from splitserve.transport.trace import mark
from splitserve.transport.transport import ExportRequest
from splitserve.wire.kv_handle import KVHandle

log = logging.getLogger(__name__)


class NoClose:
    """A per-connection marker whose resource the transport owns (SyncChannel closes attachments)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def close(self) -> None: ...


class GpuBackend(Protocol):
    """What a GPU mover (cuda_ipc.py, nccl.py) gives the `GpuTwoSided` it holds: its names and the
    hooks below, each called at one point of the two-sided fetch (the module docstring)."""

    backend: str
    open_op: str
    payload_op: str

    async def serve_open(self, chan: AsyncChannel, header: dict) -> bool:
        """Exporter: answer the backend's open request; add `open_op` to chan.notes when done."""
        ...

    def payload_fields(self, chan: AsyncChannel, block_ids: np.ndarray) -> dict:
        """Exporter: extra fields of the payload header (`chan.notes`/`request_of(chan)` say more)."""
        ...

    def fetch_fields(self, into: np.ndarray) -> dict:
        """Fetcher: extra fields of the fetch request."""
        ...

    def prefetch(self, peer: Any, handle: KVHandle, into: np.ndarray) -> Any:
        """Fetcher: work that may start as soon as the request is out (before the exporter answers);
        -> what `pull` and `settle` get."""
        ...

    def settle(self, early: Any, exc: BaseException) -> None:
        """Fetcher: a fetch failed with `exc` after `prefetch`: say on `exc` if a copy may still
        write our blocks (`TransportError.pending`)."""
        ...

    def start_push(self, chan: AsyncChannel, block_ids: np.ndarray) -> Any:
        """Exporter, on the server loop: queue what can start before the answer goes out; -> what
        `push` (or, if the answer cannot be sent, `cancel_push`) gets."""
        ...

    def cancel_push(self, chan: AsyncChannel, early: Any) -> None:
        """Exporter: the answer did not go out after `start_push`."""
        ...

    async def push(self, chan: AsyncChannel, block_ids: np.ndarray, deadline: Deadline, early: Any) -> None:
        """Exporter: after the header and state went out, send the blocks (if the backend sends)."""
        ...

    def attach(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> Any:
        """Fetcher: the open exchange on a fresh connection; -> what `pull` needs (kept on chan)."""
        ...

    def pull(
        self, chan: SyncChannel, peer: Any, meta: dict, src_ids: np.ndarray, into: np.ndarray,
        deadline: Deadline, early: Any,
    ) -> None:  # fmt: skip
        """Fetcher: move the blocks into kv_cache[into], synchronized, within the deadline."""
        ...

    def pull_state(self, peer: Any, row: int, deadline: Deadline) -> dict[str, torch.Tensor]:
        """Fetcher: the state of row `row` of the exporter's state arena (queued before `pull`, which
        waits for our side stream); a backend without an arena raises TransportError."""
        ...


class GpuTwoSided:
    """The blocks moved GPU to GPU under the control channel's leases and auth (the module docstring):
    the part cuda_ipc and nccl share, held by each (`mover.two_sided`), never subclassed. It calls its
    backend's hooks (`GpuBackend`) and keeps what both need: the device, a side stream, the counters."""

    def __init__(self, backend: GpuBackend, kv_cache: torch.Tensor, cpu_test_double: bool = False) -> None:
        """Checks made before the channel exists (a KV cache on the CPU is a start-up error)."""
        self.hooks = backend
        self.backend, self.open_op, self.payload_op = backend.backend, backend.open_op, backend.payload_op
        if kv_cache.device.type != "cuda" and not cpu_test_double:
            raise BackendUnavailable(
                f"{self.backend} moves KV from GPU to GPU: it needs the KV cache on a CUDA device, "
                f"and this worker's is on {kv_cache.device}"
            )
        if not kv_cache.is_contiguous():
            raise ValueError(f"{self.backend}: the KV cache tensor must be contiguous")

    def bind(self, port: MoverPort) -> None:
        self.port, self.kv_cache, self.layout, self.options = port, port.kv_cache, port.layout, port.options
        self.stats, self.leases, self.pool = port.stats, port.leases, port.pool
        kv = self.kv_cache
        self.rows = kv_rows(kv)
        self.gpu = gpu_uuid(kv.device)
        self.gpu_counts: Counter[str] = Counter()
        self.phases: deque[tuple[float, float, float]] = deque(maxlen=64)  # fetcher: see describe()
        self.serve_phases: deque[tuple[float, float, float]] = deque(maxlen=64)  # exporter: likewise
        self._stream = torch.cuda.Stream(kv.device) if kv.device.type == "cuda" else None

    # -- device helpers ----------------------------------------------------------------------------
    @property
    def on_cuda(self) -> bool:
        return self.kv_cache.device.type == "cuda"

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
        with torch.cuda.device(self.kv_cache.device):
            if after_current:
                self._stream.wait_stream(torch.cuda.current_stream(self.kv_cache.device))
            with torch.cuda.stream(self._stream):
                yield

    def sync_stream(self) -> None:
        if self.on_cuda:
            torch.cuda.current_stream(self.kv_cache.device).synchronize()

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

    # -- exporter side -----------------------------------------------------------------------------
    def export(self, request: ExportRequest) -> KVHandle:
        self.sync_stream()  # the prefill's writes to these blocks land before anyone reads them
        return self.port.lease_export(request, self.check_ids(request.block_ids, "block_ids"))

    async def serve_op(self, chan: AsyncChannel, header: dict) -> bool | None:
        if header["op"] == "fetch":
            chan.attached["fetch_request"] = NoClose(header)  # what the fetcher asked, for the hooks
        if header["op"] != self.open_op:
            return None  # the channel's
        try:
            return await self.hooks.serve_open(chan, header)
        except PeerRefused as exc:
            self.stats.error(exc)
            log.warning("kv %s exporter refused %s: %s", self.backend, chan.peer, exc)
            await chan.send(error_to_wire(exc), Deadline.after(self.options.connect_timeout_s))
            return False

    async def send_payload(self, call: PayloadCall) -> int:
        chan, export, block_ids, meta, fault, deadline = call.unpack()
        if self.open_op not in chan.notes:
            exc = TransportError(f"{self.backend}: fetch before {self.open_op} on this connection")
            await chan.send(error_to_wire(exc), deadline)
            raise exc
        if fault is Fault.KILL:
            return 0  # hang up instead of answering: the fetcher must fail, not hang
        start = time.perf_counter()
        mark("e.serve")
        ids = cached_ids(block_ids)
        if fault is Fault.CORRUPT:
            ids = np.roll(ids, -1)  # the wrong blocks in each place: the checksum must notice
        in_row = export.state_row is not None  # the state waits in the arena: the fetcher copies it
        state = ByteStream([] if in_row else state_pieces(export.state, self.layout))
        early = self.hooks.start_push(chan, ids)
        mark("e.queued")
        try:
            fields = self.hooks.payload_fields(chan, ids)
            header = {"op": self.payload_op, **meta, "block_ids": ids_to_wire(ids), **fields}
            if in_row:
                header["state_row"] = export.state_row
            await chan.send(header, deadline, state.nbytes)
            await chan.send_stream(state, deadline)
        except BaseException:
            self.hooks.cancel_push(chan, early)
            raise
        answered = time.perf_counter()
        mark("e.answered")
        await self.hooks.push(chan, ids, deadline, early)
        pushed = time.perf_counter()
        mark("e.pushed")
        expect(await chan.recv(deadline), "done")
        mark("e.done")
        self.serve_phases.append((answered - start, pushed - answered, time.perf_counter() - pushed))
        return len(ids) * self.layout.block_nbytes + state.nbytes

    # -- fetcher side ------------------------------------------------------------------------------
    def fetch(
        self, handle: KVHandle, into_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> dict[str, torch.Tensor]:
        into = self.check_into(handle, into_block_ids)
        deadline = Deadline.after(timeout_s if timeout_s is not None else self.options.fetch_timeout_s)
        state = empty_state(self.layout)
        body = ByteStream(state_pieces(state, self.layout))
        start = time.perf_counter()
        with counted_failures(self.stats, handle.address):
            with self.pool.for_handle(handle, deadline) as chan:
                attached = chan.attached.get(self.backend)
                if attached is None:
                    attached = chan.attached[self.backend] = self.hooks.attach(chan, handle, deadline)
                request = fetch_header(handle, deadline, self.hooks.fetch_fields(into))
                sent = time.perf_counter()
                mark("f.request")
                chan.send(request, deadline)
                early = self.hooks.prefetch(attached, handle, into)
                try:
                    header, body_nbytes = chan.recv(deadline)
                    answered = time.perf_counter()
                    mark("f.answer")
                    meta = expect(header, self.payload_op)
                    src_ids = self._peer_ids(meta, len(into))
                    in_row = meta.get("state_row") is not None
                    if body_nbytes != (0 if in_row else body.nbytes):
                        raise TransportError(
                            f"exporter sends {body_nbytes} bytes of state, we expect {body.nbytes}"
                        )
                    if in_row:  # on the exporter's GPU: copied with the blocks
                        state = self.hooks.pull_state(attached, int(meta["state_row"]), deadline)
                    else:
                        chan.recv_stream(body, deadline)
                    self.hooks.pull(chan, attached, meta, src_ids, into, deadline, early)
                    pulled = time.perf_counter()
                    mark("f.pulled")
                except BaseException as exc:
                    self.hooks.settle(early, exc)
                    raise
                deadline.remaining("copy out of the exporter's KV")  # past it the exporter may unpin
                chan.send({"op": "done"}, deadline)
            self.verify_blocks(handle, meta, into, state)
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

    def verify_blocks(self, handle: KVHandle, meta: dict, into: np.ndarray, state: dict) -> None:
        expected = handle.checksum or meta.get("checksum")
        if not expected:
            return
        pieces = source_pieces(self.kv_cache, into) + state_pieces(state, self.layout)  # host copies
        got = checksum(checksum_algo(expected), pieces)
        if got != expected:
            where = f"{handle.request_id} from {handle.address}"
            raise CorruptTransfer(f"payload of {where}: checksum {got}, expected {expected}")
        self.stats.count("checksums_verified")

    def describe(self) -> dict:
        out: dict[str, Any] = {}
        out["device"] = str(self.kv_cache.device)
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
