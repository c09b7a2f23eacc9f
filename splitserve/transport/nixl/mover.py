"""nixl: KV blocks (and a hybrid model's state slots) moved by NVIDIA NIXL READs, controlled over tcp's
authenticated channel.

The control channel is tcp's (handshake with layouts + shared secret, leases, deadlines, errors:
protocol.py); only the bytes move through NIXL (agent.py), one-sided, fetcher-initiated.

Life of a transport and of one fetch:
  0. start-up (both roles): an agent with the first of `options.nixl_backends` that NIXL can
     instantiate (a later one is a fallback: logged as an error, counted in `fallbacks`, reported as
     requested "nixl/LIBFABRIC", running "nixl/UCX"); none: BackendUnavailable with NIXL's own
     errors, and the worker does not start. The whole KV pool is registered once (DRAM or VRAM), and
     so are the engine's state-slot tensors (`register_states`, state.py) for a hybrid model.
  1. fetcher -> Fetch {lease_id, timeout_s}; exporter (lease pinned) -> KvNixl {agent, region (base
     address, size, block size, memory kind, device), block_ids, blocks, checksum} and the state: where
     the export's state is a registered slot (the engine keeps it under the lease), `state_slot` +
     `state_regions` and no body; else the state tensors (copied at export) as the frame body. On the
     connection's first fetch also `agent_md`, the exporter agent's metadata (base64), which the fetcher
     loads once per agent.
  2. fetcher: one READ of one descriptor per run of blocks consecutive on both sides (exporter ids
     from the answer, ours from `into_block_ids`) plus one per state tensor (the exporter's slot into
     `into_state`, the engine's slot of the imported request, or a registered scratch slot), polled
     against its deadline and the control connection; then -> Done. Meanwhile the exporter
     pumps its agent's progress.
  3. exporter: answers Done with Ok and drops its pin; the fetcher counts the fetch only
     after that "ok" (so the blocks were pinned for the whole READ), then checks the checksum.
     A "done" past the exporter's deadline, or a hang-up, is an error on both sides.

Every fetch reads back which backend NIXL used and reports it (`describe().backend`, "nixl/UCX"),
and how the state came (`nixl.state_reads` by NIXL, `nixl.state_inline` in the frame body).

NOTE: the fetcher can READ the exporter's whole registered pool and state slots (their memory keys are
in the metadata); it got them only after proving the shared secret.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from splitserve.transport.board import LeaseBoard
from splitserve.transport.channel import KVChannel
from splitserve.transport.client import SyncChannel, counted_failures, fetch_frame
from splitserve.transport.errors import TransportError
from splitserve.transport.export_requests import PayloadCall
from splitserve.transport.fault_plan import Fault
from splitserve.transport.frames import Done, KvNixl, Ok, Region
from splitserve.transport.layout import KVLayout, torch_dtype
from splitserve.transport.nixl.agent import NixlAgent, descriptors, paired_runs
from splitserve.transport.nixl.env import enable_cuda_ipc_get, ucx_error_mode
from splitserve.transport.nixl.state import StateSlots, peer_regions, remote_descs
from splitserve.transport.payload import (
    ByteStream,
    check_state,
    empty_state,
    host_state_pieces,
    snapshot_state,
    source_pieces,
    state_pieces,
)
from splitserve.transport.port import MoverPort
from splitserve.transport.protocol import Deadline, expect
from splitserve.transport.server import AsyncChannel, ListenSpec
from splitserve.transport.transport import ExportRequest, FetchRequest
from splitserve.wire.kv_handle import KVHandle
from splitserve.wire.transport_info import MoverInfo, NixlInfo

log = logging.getLogger(__name__)

PUMP_S = 0.0005  # the exporter pumps its agent this often while a fetch is being read


class NixlMover:
    """The fetcher READs the blocks (and state slots) with NIXL (the module docstring)."""

    backend = "nixl"

    def bind(self, port: MoverPort) -> None:
        self.port, self.kv_cache, self.layout, self.options = port, port.kv_cache, port.layout, port.options
        self.stats, self.pool = port.stats, port.pool
        kv = self.kv_cache
        if not kv.is_contiguous():
            raise ValueError("nixl needs a contiguous KV tensor (it registers the whole pool)")
        wanted = tuple(self.options.nixl_backends)
        name = f"splitserve-{os.getpid()}-{secrets.token_hex(4)}"
        self.cuda_ipc_get = enable_cuda_ipc_get(kv.device)  # before the agent's UCX context reads it
        self.agent = NixlAgent(name, wanted, ucx_error_mode(kv.device))
        self.region = self.agent.register(kv)
        self.state_slots: StateSlots | None = None  # the engine's state tensors, once registered
        self._scratch = threading.local()  # per fetch thread: a registered slot when into_state is not ours
        self.nixl_counts: Counter[str] = Counter()
        self.stats.backend = f"nixl/{self.agent.backend}"
        self.stats.requested = f"nixl/{wanted[0]}"
        if self.agent.failed:
            asked = self.stats.requested
            reasons = [f"{b}: {why}" for b, why in self.agent.failed.items()]
            log.error(
                "KV TRANSPORT FALLBACK: asked %s, runs %s (listed as a fallback in nixl_backends); %s",
                asked, self.stats.backend, "; ".join(reasons),
            )  # fmt: skip
            self.stats.fell_back(asked, reasons)

    def make_board(self) -> LeaseBoard | None:
        return None

    def export(self, request: ExportRequest) -> KVHandle:
        return self.port.lease_export(request, self.port.check_ids(request.block_ids, "block_ids"))

    async def serve_op(self, chan: AsyncChannel, header: dict) -> bool | None:
        return None  # no open exchange: the agent's metadata rides the first answer

    def listen_spec(self) -> ListenSpec:
        return ListenSpec("tcp", host=self.options.host, port=self.options.port)

    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        """Register the engine's state tensors [num_slots, *shape] with NIXL, once (state.py)."""
        if not self.layout.state_shapes:
            return False
        self.state_slots = StateSlots.register(self.agent, self.layout, states, self.kv_cache.device)
        return True

    def keep_state(self, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Views of a registered slot are kept as they are (the fetcher READs them there; the engine
        holds the slot until the lease ends); anything else is copied, as for tcp."""
        if self.state_slots is not None:
            checked = check_state(self.layout, state)
            if self.state_slots.slot_of(checked, self.layout) is not None:
                return checked
        return snapshot_state(self.layout, state)

    # -- exporter side ---------------------------------------------------------------------------
    async def send_payload(self, call: PayloadCall) -> int:
        chan, export, block_ids, fault, deadline = call.unpack()
        ids = tuple(block_ids)
        if fault is Fault.CORRUPT:
            ids = ids[1:] + ids[:1]  # point the fetcher at the wrong blocks: the checksum must notice
        slot = self.state_slots.slot_of(export.state, self.layout) if self.state_slots else None
        regions: tuple[Region, ...] = ()
        if slot is None:  # copies: in the frame body
            state = ByteStream(state_pieces(export.state, self.layout))
        else:  # still in the engine's slot: the fetcher READs it with the blocks
            state = ByteStream([])
            regions = self.state_slots.regions  # type: ignore[union-attr]
        metadata = self.agent.metadata() if "nixl_md" not in chan.notes else None
        header = KvNixl(blocks=len(ids), checksum=export.checksum, agent=self.agent.name, region=self.region,
                        block_ids=ids, agent_md=metadata, state_slot=slot, state_regions=regions)  # fmt: skip
        await chan.send(header, deadline, state.nbytes)
        chan.notes.add("nixl_md")
        await chan.send_stream(state, deadline)
        if fault is Fault.KILL:
            return 0  # hang up while the fetcher reads: it must fail (no "ok"), not hang
        pump = asyncio.ensure_future(self._pump())
        try:
            expect(await chan.recv(deadline), Done)
        finally:
            pump.cancel()
        await chan.send(Ok(), deadline)
        return len(ids) * self.layout.block_nbytes + self.layout.state_nbytes

    async def _pump(self) -> None:
        while True:
            self.agent.progress()
            await asyncio.sleep(PUMP_S)

    # -- fetcher side ----------------------------------------------------------------------------
    def fetch(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        handle, timeout_s, into_state = request.handle, request.timeout_s, request.into_state
        into = self.port.check_fetch(handle, request.into_block_ids)
        deadline = Deadline.after(timeout_s if timeout_s is not None else self.options.fetch_timeout_s)
        start = time.perf_counter()
        with counted_failures(self.stats, handle.address):
            with self.pool.for_handle(handle, deadline) as chan:
                chan.send(fetch_frame(handle, deadline), deadline)
                meta, state = self._read(chan, handle, into, into_state, deadline)
            if handle.checksum or meta.checksum:  # over host views (CPU KV) or copies (CUDA KV)
                landed = source_pieces(self.kv_cache, into) + host_state_pieces(state, self.layout)
                self.port.verify(handle, meta.checksum, ByteStream(landed))
        nbytes = len(into) * self.layout.block_nbytes + self.layout.state_nbytes
        self.stats.fetched(nbytes, time.perf_counter() - start, handle.address)
        return state

    def _read(
        self,
        chan: SyncChannel,
        handle: KVHandle,
        into: tuple[int, ...],
        into_state: Mapping[str, torch.Tensor] | None,
        deadline: Deadline,
    ) -> tuple[KvNixl, dict[str, torch.Tensor]]:
        header, body_nbytes = chan.recv(deadline)
        meta = expect(header, KvNixl)
        peer, region = meta.agent, meta.region
        self._know(peer, meta, handle)
        src = meta.block_ids
        if region.block_nbytes != self.layout.block_nbytes or len(src) != len(into):
            raise TransportError(f"exporter {handle.address} offers blocks that do not fit ours")
        if min(src) < 0 or max(src) >= region.num_blocks:
            raise TransportError(f"exporter named blocks outside its pool: {src[:16]}")
        runs = paired_runs(src, into)
        remote = descriptors(region, [r[0] for r in runs], [r[2] for r in runs])
        local = descriptors(self.region, [r[1] for r in runs], [r[2] for r in runs])
        scratch = False
        if meta.state_slot is not None:  # the state is in the exporter's registered slot: READ it too
            if body_nbytes:
                raise TransportError(f"exporter sends {body_nbytes} bytes of state besides its slot")
            regions, slot = peer_regions(meta.state_regions, self.layout, meta.state_slot, region.mem)
            state, ours, scratch = self._state_dest(into_state)
            remote = np.concatenate([remote, remote_descs(regions, slot)])
            local = np.concatenate([local, ours])
        else:
            state = empty_state(self.layout)
            states = ByteStream(state_pieces(state, self.layout))
            if body_nbytes != states.nbytes:
                raise TransportError(f"exporter sends {body_nbytes} B of state, we expect {states.nbytes}")
            chan.recv_stream(states, deadline, "receive state")
        try:
            used = self.agent.read(peer, local, self.region.mem, remote, region.mem, deadline, chan.alive)
            chan.send(Done(), deadline)
            expect(chan.recv(deadline)[0], Ok)  # the exporter held its pin for the whole READ
        except BaseException:
            if scratch:  # a late READ may still write it: never hand it out again
                self._scratch.slot = None
            raise
        if scratch:
            state = {name: t.clone() for name, t in state.items()}
        how = (
            "state_reads"
            if meta.state_slot is not None
            else "state_inline"
            if self.layout.state_shapes
            else ""
        )
        self._count_read(used, len(runs), len(local) - len(runs), how)
        return meta, state

    def _know(self, peer: str, meta: KvNixl, handle: KVHandle) -> None:
        """Load the exporter agent's metadata if it came and is new to us; it must be known after."""
        if meta.agent_md is not None and not self.agent.knows(peer):
            loaded = self.agent.load_peer(meta.agent_md)
            if loaded != peer:
                raise TransportError(
                    f"exporter {handle.address} is agent {peer} but sent {loaded}'s metadata"
                )
        if not self.agent.knows(peer):
            raise TransportError(f"exporter {handle.address} answered without its agent's metadata")

    def _state_dest(
        self, into_state: Mapping[str, torch.Tensor] | None
    ) -> tuple[dict[str, torch.Tensor], np.ndarray, bool]:
        """Where a READ of the exporter's slot lands: `into_state` where it is one of our registered
        slots; else this thread's scratch slot (registered on first use). -> (tensors, descs, scratch?)"""
        slot = self.state_slots.slot_of(into_state, self.layout) if self.state_slots else None
        if slot is not None:
            assert into_state is not None and self.state_slots is not None
            return dict(into_state), self.state_slots.descs(slot), False
        if getattr(self._scratch, "slot", None) is None:
            tensors = {name: torch.empty((1, *shape), dtype=torch_dtype(dtype), device=self.kv_cache.device)
                       for name, shape, dtype in self.layout.state_shapes}  # fmt: skip
            slots = StateSlots.register(self.agent, self.layout, tensors, self.kv_cache.device)
            self._scratch.slot = (slots, tensors)
        slots, tensors = self._scratch.slot
        return {name: t[0] for name, t in tensors.items()}, slots.descs(0), True

    def _count_read(self, used: str, ndescs: int, state_descs: int, how: str) -> None:
        with self.stats._lock:  # noqa: SLF001 - the stats' lock guards our counters too
            self.nixl_counts[f"reads_{used}"] += 1
            self.nixl_counts["descriptors"] += ndescs
            self.nixl_counts["descriptors_last"] = ndescs
            self.nixl_counts["state_descriptors_last"] = state_descs
            if how:
                self.nixl_counts[how] += 1  # state_reads (by NIXL) or state_inline (in the frame body)
            self.stats.backend = f"nixl/{used}"  # read back from NIXL, per transfer

    # -- both ------------------------------------------------------------------------------------
    def describe(self) -> MoverInfo:
        with self.stats._lock:  # noqa: SLF001
            counts = dict(self.nixl_counts)
        reads = {k.removeprefix("reads_"): n for k, n in counts.items() if k.startswith("reads_")}
        a = self.agent
        return MoverInfo(nixl=NixlInfo(
            backend=a.backend, asked=list(a.wanted), failed=dict(a.failed), module=a.module, agent=a.name,
            memory=self.region.mem, ucx_error_handling=a.ucx_error_mode, ucx_cuda_ipc_get=self.cuda_ipc_get,
            registered_bytes=self.region.nbytes, state_slots_registered=self.state_slots is not None,
            reads=reads, **{k: n for k, n in counts.items() if not k.startswith("reads_")},
        ))  # fmt: skip

    def close(self) -> None:
        self.agent.close()


class NixlTransport(KVChannel):
    """The control channel (tcp) with the nixl mover."""

    def __init__(self, kv: torch.Tensor, layout: KVLayout, **kwargs: Any) -> None:
        super().__init__(kv, layout, NixlMover(), **kwargs)
