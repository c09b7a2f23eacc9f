"""nixl: KV blocks moved by NVIDIA NIXL READs, controlled over tcp's authenticated channel.

The control channel is tcp's (handshake with layouts + shared secret, leases, deadlines, errors:
protocol.py); only the blocks move through NIXL (nixl_agent.py), one-sided, fetcher-initiated.

Life of a transport and of one fetch:
  0. start-up (both roles): an agent with the first of `options.nixl_backends` that NIXL can
     instantiate (a later one is a fallback: logged as an error, counted in `fallbacks`, reported as
     requested "nixl/LIBFABRIC", running "nixl/UCX"); none: BackendUnavailable with NIXL's own
     errors, and the worker does not start. The whole KV pool is registered once (DRAM or VRAM).
  1. fetcher -> {"op": "fetch", lease_id, timeout_s}; exporter (lease pinned) -> {"op": "kv_nixl",
     agent, region (base address, size, block size, memory kind, device), block_ids, blocks,
     checksum} + the state tensors as the frame body; on the connection's first fetch also
     `agent_md`, the exporter agent's metadata (base64), which the fetcher loads once per agent.
  2. fetcher: one READ of one descriptor per run of blocks consecutive on both sides (exporter ids
     from the answer, ours from `into_block_ids`), polled against its deadline and the control
     connection; then -> {"op": "done"}. Meanwhile the exporter pumps its agent's progress.
  3. exporter: answers "done" with {"op": "ok"} and drops its pin; the fetcher counts the fetch only
     after that "ok" (so the blocks were pinned for the whole READ), then checks the checksum.
     A "done" past the exporter's deadline, or a hang-up, is an error on both sides.

Every fetch reads back which backend NIXL used and reports it (`describe()["backend"]`, "nixl/UCX").

NOTE: the fetcher can READ the exporter's whole registered pool (its memory keys are in the
metadata); it got them only after proving the shared secret. State tensors travel in the frame
body (they are copied at export, so they are not in the registered pool).
"""

from __future__ import annotations

import asyncio
import base64
import logging
import os
import secrets
import time
from collections import Counter
from collections.abc import Sequence

import torch

from splitserve.kv.client import SyncChannel
from splitserve.kv.errors import PeerRefused, TransportError
from splitserve.kv.faults import Fault
from splitserve.kv.handle import KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.lease import FreeCallback
from splitserve.kv.nixl_agent import NixlMover, Region, descriptors, paired_runs
from splitserve.kv.payload import ByteStream, empty_state, source_pieces, state_pieces
from splitserve.kv.protocol import Deadline, expect
from splitserve.kv.server import AsyncChannel, Endpoint
from splitserve.kv.socket_transport import Export, SocketTransport
from splitserve.kv.transport import TransportOptions

log = logging.getLogger(__name__)

PUMP_S = 0.0005  # the exporter pumps its agent this often while a fetch is being read


class NixlTransport(SocketTransport):
    backend = "nixl"

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        *,
        secret: bytes | str | None = None,
        on_free: FreeCallback | None = None,
        options: TransportOptions | None = None,
    ) -> None:
        super().__init__(kv, layout, secret=secret, on_free=on_free, options=options)
        if not kv.is_contiguous():
            raise ValueError("nixl needs a contiguous KV tensor (it registers the whole pool)")
        wanted = tuple(self.options.nixl_backends)
        self.mover = NixlMover(f"splitserve-{os.getpid()}-{secrets.token_hex(4)}", wanted)
        self.region = self.mover.register(kv)
        self.nixl_counts: Counter[str] = Counter()
        self.stats.backend = f"nixl/{self.mover.backend}"
        self.stats.requested = f"nixl/{wanted[0]}"
        if self.mover.failed:
            asked = self.stats.requested
            reasons = [f"{b}: {why}" for b, why in self.mover.failed.items()]
            log.error(
                "KV TRANSPORT FALLBACK: asked %s, runs %s (listed as a fallback in nixl_backends); %s",
                asked, self.stats.backend, "; ".join(reasons),
            )  # fmt: skip
            self.stats.fell_back(asked, reasons)

    def endpoint(self) -> Endpoint:
        return Endpoint("tcp", host=self.options.host, port=self.options.port)

    # -- exporter side ---------------------------------------------------------------------------
    async def send_payload(
        self,
        chan: AsyncChannel,
        export: Export,
        block_ids: tuple[int, ...],
        meta: dict,
        fault: Fault,
        deadline: Deadline,
    ) -> int:
        ids = list(block_ids)
        if fault is Fault.CORRUPT:
            ids = ids[1:] + ids[:1]  # point the fetcher at the wrong blocks: the checksum must notice
        state = ByteStream(state_pieces(export.state, self.layout))
        header = {"op": "kv_nixl", **meta, "agent": self.mover.name, "region": self.region.to_wire(),
                  "block_ids": ids}  # fmt: skip
        if "nixl_md" not in chan.notes:
            header["agent_md"] = base64.b64encode(self.mover.metadata()).decode()
        await chan.send(header, deadline, state.nbytes)
        chan.notes.add("nixl_md")
        await chan.send_stream(state, deadline)
        if fault is Fault.KILL:
            return 0  # hang up while the fetcher reads: it must fail (no "ok"), not hang
        pump = asyncio.ensure_future(self._pump())
        try:
            expect(await chan.recv(deadline), "done")
        finally:
            pump.cancel()
        await chan.send({"op": "ok"}, deadline)
        return len(ids) * self.layout.block_nbytes + state.nbytes

    async def _pump(self) -> None:
        while True:
            self.mover.progress()
            await asyncio.sleep(PUMP_S)

    def recv_payload(self, chan: SyncChannel, stream: ByteStream, deadline: Deadline) -> dict:
        raise NotImplementedError("nixl fetches are not read off the socket; see NixlTransport.fetch")

    # -- fetcher side ----------------------------------------------------------------------------
    def fetch(
        self, handle: KVHandle, into_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> dict[str, torch.Tensor]:
        into = self._check_fetch(handle, into_block_ids)
        deadline = Deadline.after(timeout_s if timeout_s is not None else self.options.fetch_timeout_s)
        state = empty_state(self.layout)
        start = time.perf_counter()
        try:
            with self.pool.connection(handle.address, deadline) as chan:
                if chan.peer_layout is not None and chan.peer_layout.fingerprint != handle.layout_fingerprint:
                    raise PeerRefused(f"handle {handle.request_id} was made for another layout")
                request = {"op": "fetch", "lease_id": handle.lease_id, "request_id": handle.request_id}
                chan.send({**request, "timeout_s": deadline.remaining("fetch")}, deadline)
                meta = self._read(chan, handle, into, state, deadline)
            if handle.checksum or meta.get("checksum"):  # over host views (CPU KV) or copies (CUDA KV)
                landed = source_pieces(self.kv, into) + state_pieces(state, self.layout)
                self._verify(handle, meta, ByteStream(landed))
        except TransportError as exc:
            self.stats.error(exc)
            raise
        except (KeyError, TypeError, ValueError) as exc:  # a field missing or mistyped in an answer
            malformed = TransportError(f"malformed answer from {handle.address}: {exc!r}")
            self.stats.error(malformed)
            raise malformed from exc
        nbytes = len(into) * self.layout.block_nbytes + self.layout.state_nbytes
        self.stats.fetched(nbytes, time.perf_counter() - start, handle.address)
        return state

    def _read(
        self, chan: SyncChannel, handle: KVHandle, into: tuple[int, ...], state: dict, deadline: Deadline
    ) -> dict:
        header, body_nbytes = chan.recv(deadline)
        meta = expect(header, "kv_nixl")
        peer, region = str(meta["agent"]), Region.from_wire(meta["region"])
        if "agent_md" in meta and not self.mover.knows(peer):
            loaded = self.mover.load_peer(base64.b64decode(meta["agent_md"]))
            if loaded != peer:
                raise TransportError(
                    f"exporter {handle.address} is agent {peer} but sent {loaded}'s metadata"
                )
        if not self.mover.knows(peer):
            raise TransportError(f"exporter {handle.address} answered without its agent's metadata")
        src = [int(b) for b in meta["block_ids"]]
        if region.block_nbytes != self.layout.block_nbytes or len(src) != len(into):
            raise TransportError(f"exporter {handle.address} offers blocks that do not fit ours")
        if min(src) < 0 or max(src) >= region.num_blocks:
            raise TransportError(f"exporter named blocks outside its pool: {src[:16]}")
        states = ByteStream(state_pieces(state, self.layout))
        if body_nbytes != states.nbytes:
            raise TransportError(f"exporter sends {body_nbytes} bytes of state, we expect {states.nbytes}")
        chan.recv_stream(states, deadline, "receive state")
        runs = paired_runs(src, into)
        remote = descriptors(region, [r[0] for r in runs], [r[2] for r in runs])
        local = descriptors(self.region, [r[1] for r in runs], [r[2] for r in runs])
        used = self.mover.read(peer, local, self.region.mem, remote, region.mem, deadline, chan.alive)
        chan.send({"op": "done"}, deadline)
        expect(chan.recv(deadline)[0], "ok")  # the exporter held its pin for the whole READ
        self._count_read(used, len(runs))
        return meta

    def _count_read(self, used: str, ndescs: int) -> None:
        with self.stats._lock:  # noqa: SLF001 - the stats' lock guards our counters too
            self.nixl_counts[f"reads_{used}"] += 1
            self.nixl_counts["descriptors"] += ndescs
            self.nixl_counts["descriptors_last"] = ndescs
            self.stats.backend = f"nixl/{used}"  # read back from NIXL, per transfer

    # -- both ------------------------------------------------------------------------------------
    def describe(self) -> dict:
        out = super().describe()
        with self.stats._lock:  # noqa: SLF001
            counts = dict(self.nixl_counts)
        out["nixl"] = {
            "backend": self.mover.backend,
            "asked": list(self.mover.wanted),
            "failed": dict(self.mover.failed),
            "module": self.mover.module,
            "agent": self.mover.name,
            "memory": self.region.mem,
            "registered_bytes": self.region.nbytes,
            **counts,
        }
        return out

    def close(self) -> None:
        super().close()
        self.mover.close()
