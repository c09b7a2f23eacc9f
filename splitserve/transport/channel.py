"""KVChannel: the one KV transport, a control channel holding one payload mover per backend.

The channel owns what every backend shares: the exporter's server and the fetcher's pooled
authenticated connections (handshake: layouts + shared secret), leases, deadlines, counters, the fault
plan (tests only). The mover (`PayloadMover` below: tcp, shm, cuda_ipc, nccl, nixl) owns how the
payload moves.

Exporter side, for one request:
  1. `export` -> the mover's `export`, which checks the ids and calls back `lease_export`: the state
     the mover keeps (`keep_state`: host copies, or a slot/arena row), the checksum if enabled, and a
     lease whose payload is an `Export` record; the server starts on first use (`listen`).
  2. A request arrives on the server loop: `ExportRequests.handle` (export_requests.py) offers it to
     the mover first (`serve_op`: its open exchange), else a fetch pins the lease (so it cannot end
     mid-read), draws a fault from the plan when one is installed, and calls the mover's `send_payload`.
  3. A release request (or `release` of our own handle) ends the lease: `on_free(block_ids)` once.

Fetcher side, for one request:
  1. `fetch` -> the mover's `fetch`. The stream movers (tcp, shm) call back `stream_fetch`: it checks
     the handle against this transport (backend, block counts, id range), builds the destination
     stream (our kv[into_block_ids] views + fresh state tensors), takes a pooled connection and lets
     the mover's `recv_payload` fill the stream;
  2. then verifies the checksum (CorruptTransfer), commits staged blocks (device KV), records GB/s.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Protocol

import msgspec
import torch

from splitserve.config.kv_backends import ACROSS_SIZES
from splitserve.transport.board import LeaseBoard
from splitserve.transport.client import ConnectionPool, counted_failures, fetch_frame
from splitserve.transport.errors import (
    BackendUnavailable,
    CorruptTransfer,
    PeerRefused,
    TransportError,
)
from splitserve.transport.export_requests import Export, ExportRequests, PayloadCall
from splitserve.transport.fabric import host_fabric
from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.frames import Frame, Ok, Payload, Release, Select
from splitserve.transport.layout import KVLayout
from splitserve.transport.lease import FreeCallback, LeaseManager
from splitserve.transport.part_sink import PartSink, PartTarget
from splitserve.transport.payload import (
    BlockSink,
    ByteStream,
    empty_state,
    host_state_pieces,
    source_pieces,
    state_pieces,
)
from splitserve.transport.port import MoverPort
from splitserve.transport.protocol import Deadline, checksum, checksum_algo, expect, resolve_secret
from splitserve.transport.server import AsyncChannel, ExportServer, ListenSpec
from splitserve.transport.transport import (
    ExportRequest,
    FetchRequest,
    KVTransport,
    TransportOptions,
    TransportStats,
)
from splitserve.wire.kv_handle import KVHandle
from splitserve.wire.transport_info import LeaseCounts, MoverInfo, TransportInfo

log = logging.getLogger(__name__)


class PayloadMover(Protocol):
    """What one backend adds to the control channel, and nothing else.

    A `KVChannel` holds one mover and calls it; a mover never subclasses the channel, another backend's
    mover or a shared base. Its contract, by side (the channel calls these; the mover may use the
    channel's parts and steps on the `MoverPort` it is bound to, port.py: `port`):

      both      backend                           the backend's name, carried in handles
                bind(port)                        once, when the channel is made: keep it, set up devices
                register_states(states) -> bool   the engine's state slots, once (True: moved in place)
                describe() -> MoverInfo           its part of the channel's describe() (wire/transport_info)
                close()                           after the channel closed its server, pool and leases
      exporter  listen_spec() -> ListenSpec       where the server listens (tcp host:port, unix path)
                make_board() -> LeaseBoard|None   a lease board for one-sided reads (board.py), or None
                export(request) -> KVHandle       check the ids, then `port.lease_export` (or its own lease)
                keep_state(state) -> dict         what a lease keeps of the state (`lease_export` asks)
                serve_op(chan, frame) -> bool|None    a request only this backend knows (its open
                                                  exchange); None: not ours, the channel serves it
                send_payload(call: PayloadCall) -> int
                                                  move the pinned lease's blocks and state; -> bytes
      fetcher   fetch(request: FetchRequest) -> state
                                                  stream movers: `port.stream_fetch(..., recv_payload)`

    The backends: stream/tcp.py and stream/shm.py (one stream/mover.py StreamMover over the backend's
    StreamWire), gpu/cuda_ipc.py and gpu/nccl.py (one gpu/mover.py GpuMover over the backend's
    GpuLink), nixl/mover.py (one-sided NIXL READs). What two backends share is composed (a mover over
    a wire or a link), never a base class.
    """

    backend: str

    def bind(self, port: MoverPort) -> None: ...

    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool: ...

    def describe(self) -> MoverInfo: ...

    def close(self) -> None: ...

    def listen_spec(self) -> ListenSpec: ...

    def make_board(self) -> LeaseBoard | None: ...

    def export(self, request: ExportRequest) -> KVHandle: ...

    def keep_state(self, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]: ...

    async def serve_op(self, chan: AsyncChannel, frame: Frame) -> bool | None: ...

    async def send_payload(self, call: PayloadCall) -> int: ...

    def fetch(self, request: FetchRequest) -> dict[str, torch.Tensor]: ...


class KVChannel(KVTransport):
    """A control channel holding one backend's payload mover (see the module docstring)."""

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        mover: PayloadMover,
        *,
        secret: bytes | str | None = None,
        on_free: FreeCallback | None = None,
        options: TransportOptions | None = None,
    ) -> None:
        _check_kv(kv, layout)
        self.mover = mover
        self.backend = mover.backend
        self.kv_cache = kv  # [num_blocks, L, 2, block_size, KVH, D]
        self.layout = layout
        self.options = options or TransportOptions()
        self._secret = resolve_secret(secret)
        self.stats = TransportStats(self.backend)
        self.leases = LeaseManager(self.options.lease_s, on_free)
        self.pool = ConnectionPool(layout, self._secret, self.options.connect_timeout_s)
        self.faults: FaultPlan | None = None
        self._server: ExportServer | None = None
        self._lock = threading.Lock()
        self._closed = False
        self.requests = ExportRequests(mover, self.leases, self.options, self.stats, lambda: self.faults)
        self.port = MoverPort(
            kv, layout, self.options, self.stats, self.leases, self.pool, self.listen, self.lease_export,
            self.check_ids, self.check_fetch, self.verify, self.stream_fetch,
        )  # fmt: skip
        mover.bind(self.port)

    # -- exporter side ---------------------------------------------------------------------------
    def listen(self) -> str:
        """Start serving (once); -> the address handles carry."""
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.backend} transport is closed")
            if self._server is None:
                if self.leases.board is None:  # before the server: a fetcher's open exchange names it
                    self.leases.board = self.mover.make_board()
                    if self.leases.board is not None:
                        self.leases.board.allow_one_sided(self.faults is None)
                server = ExportServer(
                    self.mover.listen_spec(),
                    self.layout,
                    self._secret,
                    self.requests,
                    self.options.connect_timeout_s,
                    self.options.idle_timeout_s,
                )
                server.start()
                self._server = server
            return self._server.address

    def export_request(self, request: ExportRequest) -> KVHandle:
        return self.mover.export(request)

    def lease_export(self, request: ExportRequest, ids: tuple[int, ...]) -> KVHandle:
        """A mover's `export`, once it has checked the request's block ids (-> `ids`): keep the state
        (the mover's `keep_state`), the checksum, the lease, the handle."""
        request_id, num_tokens = request.request_id, request.num_tokens
        if not 0 < num_tokens <= len(ids) * self.layout.block_size:
            raise ValueError(f"num_tokens {num_tokens} does not fit in {len(ids)} blocks")
        snapshot = self.mover.keep_state(request.state)
        address = self.listen()
        digest = None
        if self.options.checksum:
            pieces = source_pieces(self.kv_cache, ids) + host_state_pieces(snapshot, self.layout)
            digest = checksum(self.options.checksum, pieces)
        lease = self.leases.grant(ids, Export(request_id, snapshot, digest))
        self.stats.count("exports")
        return KVHandle(
            backend=self.backend,
            address=address,
            request_id=request_id,
            lease_id=lease.lease_id,
            block_ids=ids,
            num_tokens=num_tokens,
            layout_fingerprint=self.layout.fingerprint,
            lease_expires_at=time.time() + self.options.lease_s,
            checksum=digest,
            lease_slot=lease.slot,
        )

    def release(self, handle: KVHandle) -> None:
        self.stats.count("releases")
        if self._server is not None and handle.address == self._server.address:
            self.leases.release(handle.lease_id)
            return
        deadline = Deadline.after(self.options.connect_timeout_s)
        try:
            with self.pool.connection(handle.address, deadline) as chan:
                chan.send(Release(lease_id=handle.lease_id), deadline)
                expect(chan.recv(deadline)[0], Ok)
        except TransportError as exc:
            self.stats.error(exc)
            log.warning(
                "kv release of %s at %s failed (%s); the exporter frees it when the lease expires",
                handle.request_id,
                handle.address,
                exc,
            )

    # -- fetcher side ----------------------------------------------------------------------------
    def fetch_request(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        return self.mover.fetch(request)

    def stream_fetch(
        self,
        request: FetchRequest,
        recv_payload: Callable[..., Payload],
        part: tuple[Select, ByteStream] | None = None,
    ) -> dict[str, torch.Tensor]:
        """A stream mover's `fetch`: `recv_payload(chan, stream, deadline, select)` fills our blocks'
        views and fresh state tensors (or, for `part`, the views it names), and answers the exporter's
        payload frame; -> the state (none for a part)."""
        handle, timeout_s = request.handle, request.timeout_s
        into = self.check_fetch(handle, request.into_block_ids) if part is None else ()
        deadline = Deadline.after(timeout_s if timeout_s is not None else self.options.fetch_timeout_s)
        if part is None:
            select, sink, state = None, BlockSink(self.kv_cache, into), empty_state(self.layout)
            stream = ByteStream(sink.pieces + state_pieces(state, self.layout))
        else:  # the exporter's checksum covers its whole payload: the part's comes with it
            (select, stream), sink, state = part, None, {}
            handle = msgspec.structs.replace(handle, checksum=None)
        start = time.perf_counter()
        with counted_failures(self.stats, handle.address):
            with self.pool.for_handle(handle, deadline) as chan:
                chan.send(fetch_frame(handle, deadline, select=select), deadline)
                payload = recv_payload(chan, stream, deadline, select)
            self.verify(handle, payload.checksum, stream)
            if sink is not None:
                sink.commit()
        self.stats.fetched(stream.nbytes, time.perf_counter() - start, handle.address)
        return state

    def fetch_part(self, request: FetchRequest, select: Select, into: ByteStream) -> None:
        """Fetch only the `select`ed heads and state channels of the handle's payload (the exporter's
        layout, this channel's) into `into`: views of another tensor, such as a tensor-parallel rank's
        pool of a different layout. The stream backends only (tcp, shm; cuda_ipc: `read_part`)."""
        fetch_part = getattr(self.mover, "fetch_part", None)
        if fetch_part is None:
            raise BackendUnavailable(
                f"{self.backend} cannot fetch part of a payload into host views "
                f"(across tensor_parallel sizes use {', '.join(ACROSS_SIZES)})"
            )
        fetch_part(request, select, into)

    def read_part(self, request: FetchRequest, select: Select, target: PartTarget) -> int:
        """The `select`ed heads and state channels of the handle's payload into `target`: a rank's own
        blocks and fresh state tensors, of another layout than this channel's (tensor parallelism at
        another size); -> the bytes written there. A mover that copies a part on the device does so
        (cuda_ipc); a stream mover's bytes land through a PartSink (part_sink.py)."""
        read_part = getattr(self.mover, "read_part", None)
        if read_part is not None:
            return read_part(request, select, target)
        sink = PartSink(*target)
        self.fetch_part(request, select, ByteStream(sink.pieces))
        sink.commit()
        return sink.nbytes

    @property
    def part_state_device(self) -> torch.device:
        """Where a rank reading parts over this channel keeps its fresh state tensors: on the KV's device
        for a mover that copies parts there (cuda_ipc), else on the host (the stream movers)."""
        return self.kv_cache.device if hasattr(self.mover, "read_part") else torch.device("cpu")

    def verify(self, handle: KVHandle, sent: str | None, stream: ByteStream) -> None:
        """The payload's checksum against the handle's (else the one the exporter `sent` with it)."""
        expected = handle.checksum or sent
        if not expected:
            return
        got = checksum(checksum_algo(expected), stream.pieces)
        if got != expected:
            where = f"{handle.request_id} from {handle.address}"
            raise CorruptTransfer(f"payload of {where}: checksum {got}, expected {expected}")
        self.stats.count("checksums_verified")

    def check_fetch(self, handle: KVHandle, into_block_ids: Sequence[int]) -> tuple[int, ...]:
        if handle.backend != self.backend:
            diff = f"backend: ours {self.backend}, peer {handle.backend}"
            raise PeerRefused("handle is for another backend", [diff])
        into = self.check_ids(into_block_ids, "into_block_ids")
        if len(into) != handle.num_blocks:
            raise ValueError(f"the handle has {handle.num_blocks} blocks, into_block_ids has {len(into)}")
        return into

    def check_ids(self, block_ids: Sequence[int], what: str) -> tuple[int, ...]:
        ids = tuple(int(b) for b in block_ids)
        if not ids:
            raise ValueError(f"{what} is empty")
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= self.kv_cache.shape[0]:
            raise ValueError(
                f"{what} must be distinct ids in [0, {self.kv_cache.shape[0]}), got {list(ids)[:16]}"
            )
        return ids

    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        with self.pool.connection(address, Deadline.after(timeout_s)) as chan:
            assert chan.peer_layout is not None  # the handshake sets it
            return chan.peer_layout

    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return self.mover.register_states(states)

    # -- both ------------------------------------------------------------------------------------
    def install_faults(self, plan: FaultPlan | None) -> None:
        """Tests: break the exporter's answers according to `plan` (see faults.py). While a plan is
        installed, fetchers are told to ask (no one-sided reads), so that every fetch meets it."""
        self.faults = plan
        if self.leases.board is not None:
            self.leases.board.allow_one_sided(plan is None)

    @property
    def address(self) -> str | None:
        return self._server.address if self._server else None

    def describe(self) -> TransportInfo:
        ended = self.leases.counts
        return TransportInfo(
            **self.stats.snapshot(), **msgspec.structs.asdict(self.mover.describe()),
            address=self.address, layout_fingerprint=self.layout.fingerprint, checksum=self.options.checksum,
            leases=LeaseCounts(self.leases.active(), ended["granted"], ended["released"], ended["expired"]),
            connections_opened=self.pool.opened, connections_reaped=self.pool.reaped,
            server=None if self._server is None else dict(self._server.counts),
            faults=None if self.faults is None else dict(self.faults.counts),
            fabric=host_fabric().info(self.stats.backend, self.kv_cache.device.type == "cuda"),
        )  # fmt: skip

    def close(self) -> None:
        with self._lock:
            self._closed = True
            server, self._server = self._server, None
        if server is not None:
            server.close()
        self.pool.close()
        self.leases.close(free_remaining=True)
        if self.leases.board is not None:
            self.leases.board.close()
        self.mover.close()


_TENSOR_FIELDS = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")


def _check_kv(kv: torch.Tensor, layout: KVLayout) -> None:
    ours = KVLayout.from_tensor(kv, layout.model_fingerprint, layout.state_shapes)
    wrong = [m for m in ours.mismatches(layout) if m.split(":")[0] in _TENSOR_FIELDS]
    if wrong:
        raise ValueError(f"kv tensor {tuple(kv.shape)} does not match the layout: {'; '.join(wrong)}")
