"""SocketTransport: what the tcp and shm backends share; they differ only in how the payload moves.

Exporter side, for one request:
  1. `export` checks the ids and state, copies the (small) state tensors, computes the checksum if
     enabled, and grants a lease whose payload is an `Export` record; the server starts on first use.
  2. A fetch request arrives on the server loop: `handle` pins the lease (so it cannot end mid-read),
     asks the fault plan (tests only) what to break, and calls the backend's `send_payload`, which
     sends the leased blocks (zero-copy views, payload.py) and the state copies.
  3. A release request (or `release` of our own handle) ends the lease: `on_free(block_ids)` once.

Fetcher side, for one request:
  1. `fetch` checks the handle against this transport (backend, block counts, id range), builds the
     destination stream (our kv[into_block_ids] views + fresh state tensors), takes a pooled
     authenticated connection and lets the backend's `recv_payload` fill the stream.
  2. It verifies the checksum (CorruptTransfer), commits staged blocks (device KV), records GB/s.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from abc import abstractmethod
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitserve.kv import trace
from splitserve.kv.board import LeaseBoard
from splitserve.kv.client import ConnectionPool, SyncChannel
from splitserve.kv.errors import (
    CorruptTransfer,
    LeaseExpired,
    PeerRefused,
    TransportError,
    UnknownLease,
    error_to_wire,
)
from splitserve.kv.faults import Fault, FaultPlan
from splitserve.kv.handle import KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import FreeCallback, LeaseManager
from splitserve.kv.payload import (
    BlockSink,
    ByteStream,
    empty_state,
    host_state_pieces,
    snapshot_state,
    source_pieces,
    state_pieces,
)
from splitserve.kv.protocol import Deadline, checksum, checksum_algo, expect, resolve_secret
from splitserve.kv.server import AsyncChannel, Endpoint, ExportServer
from splitserve.kv.transport import KVTransport, TransportOptions, TransportStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Export:
    """What the exporter keeps under a lease besides the block ids."""

    request_id: str
    state: dict[str, torch.Tensor]
    checksum: str | None
    state_row: int | None = None  # cuda_ipc: the state waits in this row of the exporter's arena


class SocketTransport(KVTransport):
    backend = "socket"

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        *,
        secret: bytes | str | None = None,
        on_free: FreeCallback | None = None,
        options: TransportOptions | None = None,
    ) -> None:
        _check_kv(kv, layout)
        self.kv = kv  # [num_blocks, L, 2, block_size, KVH, D]
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

    # -- backend hooks ---------------------------------------------------------------------------
    @abstractmethod
    def endpoint(self) -> Endpoint:
        """Where the exporter listens."""

    def make_board(self) -> LeaseBoard | None:
        """Exporter: a lease board for one-sided fetches (board.py), made when serving starts."""
        return None

    @abstractmethod
    async def send_payload(
        self,
        chan: AsyncChannel,
        export: Export,
        block_ids: tuple[int, ...],
        meta: dict,
        fault: Fault,
        deadline: Deadline,
    ) -> int:
        """Exporter: move the leased blocks and the state to the fetcher (its answer header carries
        `meta`); -> bytes moved."""

    @abstractmethod
    def recv_payload(self, chan: SyncChannel, stream: ByteStream, deadline: Deadline) -> dict:
        """Fetcher: fill `stream`; -> the exporter's payload header."""

    # -- exporter side ---------------------------------------------------------------------------
    def listen(self) -> str:
        """Start serving (once); -> the address handles carry."""
        with self._lock:
            if self._closed:
                raise TransportError(f"{self.backend} transport is closed")
            if self._server is None:
                if self.leases.board is None:  # before the server: a fetcher's open exchange names it
                    self.leases.board = self.make_board()
                    if self.leases.board is not None:
                        self.leases.board.allow_one_sided(self.faults is None)
                server = ExportServer(
                    self.endpoint(),
                    self.layout,
                    self._secret,
                    self,
                    self.options.connect_timeout_s,
                    self.options.idle_timeout_s,
                )
                server.start()
                self._server = server
            return self._server.address

    def export(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> KVHandle:
        ids = self._check_ids(block_ids, "block_ids")
        if not 0 < num_tokens <= len(ids) * self.layout.block_size:
            raise ValueError(f"num_tokens {num_tokens} does not fit in {len(ids)} blocks")
        snapshot = self.keep_state(state)
        address = self.listen()
        digest = None
        if self.options.checksum:
            pieces = source_pieces(self.kv, ids) + host_state_pieces(snapshot, self.layout)
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

    def keep_state(self, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """What the lease keeps of the request's state: host copies (the engine reuses its slot at once)."""
        return snapshot_state(self.layout, state)

    def release(self, handle: KVHandle) -> None:
        self.stats.count("releases")
        if self._server is not None and handle.address == self._server.address:
            self.leases.release(handle.lease_id)
            return
        deadline = Deadline.after(self.options.connect_timeout_s)
        try:
            with self.pool.connection(handle.address, deadline) as chan:
                chan.send({"op": "release", "lease_id": handle.lease_id}, deadline)
                expect(chan.recv(deadline)[0], "ok")
        except TransportError as exc:
            self.stats.error(exc)
            log.warning(
                "kv release of %s at %s failed (%s); the exporter frees it when the lease expires",
                handle.request_id,
                handle.address,
                exc,
            )

    async def handle(self, chan: AsyncChannel, header: dict) -> bool:
        """Server loop: serve one request (RequestHandler)."""
        op = header["op"]
        if op == "fetch":
            return await self._serve_fetch(chan, header)
        if op == "release":
            released = self.leases.release(str(header.get("lease_id")))
            deadline = Deadline.after(self.options.connect_timeout_s)
            await chan.send({"op": "ok", "released": released}, deadline)
            return True
        if op == "error":
            log.warning("kv fetcher %s refused us: %s", chan.peer, header.get("message"))
            return False
        bad = TransportError(f"unknown request {op!r}")
        await chan.send(error_to_wire(bad), Deadline.after(self.options.connect_timeout_s))
        return False

    async def _serve_fetch(self, chan: AsyncChannel, header: dict) -> bool:
        trace.mark("e.request")
        asked = float(header.get("timeout_s", self.options.fetch_timeout_s))
        deadline = Deadline.after(min(max(asked, 0.001), self.options.max_fetch_s))
        try:
            with self.leases.pinned(str(header.get("lease_id"))) as lease:
                fault = self.faults.draw() if self.faults else Fault.NONE
                if fault is Fault.DROP:  # never answer; hold on until the fetcher gives up
                    await chan.wait_closed(Deadline.after(self.options.idle_timeout_s))
                    return False
                if fault is Fault.DELAY:
                    await asyncio.sleep(self.faults.knobs.delay_s)  # type: ignore[union-attr]
                meta = {"blocks": len(lease.block_ids), "checksum": lease.payload.checksum}
                start = time.perf_counter()
                nbytes = await self.send_payload(chan, lease.payload, lease.block_ids, meta, fault, deadline)
                self.stats.served(nbytes, time.perf_counter() - start)
                return fault is not Fault.KILL
        except (LeaseExpired, UnknownLease) as exc:
            self.stats.error(exc)
            await chan.send(error_to_wire(exc), deadline)
            return True
        except (TransportError, ConnectionError):
            self.stats.count("serve_failures")
            raise

    # -- fetcher side ----------------------------------------------------------------------------
    def fetch(
        self,
        handle: KVHandle,
        into_block_ids: Sequence[int],
        timeout_s: float | None = None,
        into_state: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        into = self._check_fetch(handle, into_block_ids)
        deadline = Deadline.after(timeout_s if timeout_s is not None else self.options.fetch_timeout_s)
        sink, state = BlockSink(self.kv, into), empty_state(self.layout)
        stream = ByteStream(sink.pieces + state_pieces(state, self.layout))
        start = time.perf_counter()
        try:
            with self.pool.connection(handle.address, deadline) as chan:
                if chan.peer_layout is not None and chan.peer_layout.fingerprint != handle.layout_fingerprint:
                    raise PeerRefused(f"handle {handle.request_id} was made for another layout")
                request = {"op": "fetch", "lease_id": handle.lease_id, "request_id": handle.request_id}
                chan.send({**request, "timeout_s": deadline.remaining("fetch")}, deadline)
                meta = self.recv_payload(chan, stream, deadline)
            self._verify(handle, meta, stream)
            sink.commit()
        except TransportError as exc:
            self.stats.error(exc)
            raise
        except (KeyError, TypeError, ValueError) as exc:  # a field missing or mistyped in an answer
            malformed = TransportError(f"malformed answer from {handle.address}: {exc!r}")
            self.stats.error(malformed)
            raise malformed from exc
        self.stats.fetched(stream.nbytes, time.perf_counter() - start, handle.address)
        return state

    def _verify(self, handle: KVHandle, meta: dict, stream: ByteStream) -> None:
        expected = handle.checksum or meta.get("checksum")
        if not expected:
            return
        got = checksum(checksum_algo(expected), stream.pieces)
        if got != expected:
            where = f"{handle.request_id} from {handle.address}"
            raise CorruptTransfer(f"payload of {where}: checksum {got}, expected {expected}")
        self.stats.count("checksums_verified")

    def _check_fetch(self, handle: KVHandle, into_block_ids: Sequence[int]) -> tuple[int, ...]:
        if handle.backend != self.backend:
            diff = f"backend: ours {self.backend}, peer {handle.backend}"
            raise PeerRefused("handle is for another backend", [diff])
        into = self._check_ids(into_block_ids, "into_block_ids")
        if len(into) != handle.num_blocks:
            raise ValueError(f"the handle has {handle.num_blocks} blocks, into_block_ids has {len(into)}")
        return into

    def _check_ids(self, block_ids: Sequence[int], what: str) -> tuple[int, ...]:
        ids = tuple(int(b) for b in block_ids)
        if not ids:
            raise ValueError(f"{what} is empty")
        if len(set(ids)) != len(ids) or min(ids) < 0 or max(ids) >= self.kv.shape[0]:
            raise ValueError(f"{what} must be distinct ids in [0, {self.kv.shape[0]}), got {list(ids)[:16]}")
        return ids

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

    def describe(self) -> dict:
        out = self.stats.snapshot()
        out["address"] = self.address
        out["layout_fingerprint"] = self.layout.fingerprint
        out["checksum"] = self.options.checksum
        out["leases"] = {"active": self.leases.active(), **self.leases.counts}
        out["connections_opened"] = self.pool.opened
        out["connections_reaped"] = self.pool.reaped
        if self._server is not None:
            out["server"] = dict(self._server.counts)
        if self.faults is not None:
            out["faults"] = dict(self.faults.counts)
        return out

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


_TENSOR_FIELDS = ("dtype", "block_size", "num_layers", "num_kv_heads", "head_dim")


def _check_kv(kv: torch.Tensor, layout: KVLayout) -> None:
    ours = KVLayout.from_tensor(kv, layout.model_fingerprint, layout.state_shapes)
    wrong = [m for m in ours.mismatches(layout) if m.split(":")[0] in _TENSOR_FIELDS]
    if wrong:
        raise ValueError(f"kv tensor {tuple(kv.shape)} does not match the layout: {'; '.join(wrong)}")
