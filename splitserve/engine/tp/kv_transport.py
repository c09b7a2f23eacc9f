"""KV transfer between replicas of different tensor-parallel sizes.

Prefill replica at size P: one transport (and server) per rank, each over that rank's own pool, all
in rank 0's process (the pools of ranks 1..P-1 are shared memory it maps: pools.py). An export leases
the request's blocks and copies its state on every rank; the handle names P and each rank's address,
lease and layout (`KVHandle.shards`), and is stamped with the model's unsharded layout, so that a
decode replica of any size accepts it. The engine's blocks are freed once every rank's lease ended.

Decode replica at size D (`ShardedFetch`): each decode rank reads its own share in its own process,
into its own pool (rank_reads.py; read_orders.py: rank 0 orders the other ranks' reads and waits for
all of them; a failure on any rank fails the fetch):
  - P == D with the same rank layouts: decode rank d fetches prefill rank d's whole shard;
  - otherwise (P > D gathers several prefill ranks into one decode rank, P < D slices one among
    several, a KV head replicated below the rank count is read by each rank that holds it): each
    decode rank reads, from each prefill rank holding some of its heads and state channels, only
    those (a fetch that `select`s runs of heads and channels, kv_routes.py's `parts`), over a channel
    of that prefill rank's layout that is its own, into its own blocks and fresh state tensors
    (transport/part_sink.py): every byte crosses the wire once, and each rank's counters show its
    own share. A size pair the model cannot be split into is refused before any byte moves, naming
    both sizes; a rank layout the exporter does not have is refused by its handshake, in the same words.
The state decode ranks 1..D-1 read stays in their processes; it comes back as `name@rank` keys holding
a `Held`, which the engine's state pool sends with the next step (journal.py's "put").
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Mapping, Sequence

import msgspec
import torch

from splitserve.engine.tp.kv_routes import Plan, Sharding
from splitserve.engine.tp.rank_reads import Held, Opener, RankReader, left_s, shard_handle, shards_of
from splitserve.engine.tp.read_orders import ReadDone, RemoteReads
from splitserve.model.config import ModelConfig
from splitserve.transport.errors import PeerRefused
from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.layout import KVLayout, torch_dtype
from splitserve.transport.lease import FreeCallback
from splitserve.transport.transport import ExportRequest, FetchRequest, KVTransport
from splitserve.wire.kv_handle import KVHandle, KVShard
from splitserve.wire.transport_info import RankParts, TensorParallelInfo, TransportInfo

MAX_PEER_SIZE = 8  # the largest exporter size `check_peer` tries


class ShardedFetch:
    """Decode side: fill our ranks' pools from a handle of any exporter size (rank 0's own here, each
    other rank's in that rank's process: rank_reads.py), and release such handles (each rank's lease
    through a connection of that rank's layout)."""

    def __init__(
        self,
        cfg: ModelConfig,
        full: KVLayout,
        kv: torch.Tensor,
        direct: Sequence[KVTransport],
        opener: Opener,
        remote: RemoteReads | None = None,
    ) -> None:
        self.cfg, self.full, self.direct, self.opener, self.remote = cfg, full, list(direct), opener, remote
        self.size = len(self.direct)
        self.local = RankReader(cfg, full, 0, self.size, kv, opener, own=self.direct[0])
        self.layouts = [Sharding.of(cfg, self.size).rank_layout(full, r) for r in range(self.size)]
        self.rank_bytes = [0] * self.size  # KV and state bytes written into each rank's pool
        self.remote_parts = [RankParts() for _ in range(self.size)]  # ranks 1.., from their outcomes
        self._lock = threading.Lock()

    @property
    def peers(self) -> dict:
        """Rank 0's fetch-only channels (prefill layout fingerprint, prefill rank) -> channel."""
        return self.local.peers

    def fetch(self, handle: KVHandle, into: Sequence[int], timeout_s: float) -> dict[str, object]:
        """Every rank's share of `handle` into its pool, each rank reading in its own process; ->
        rank 0's state tensors, and each other rank's as `name@rank` -> `Held` (kept by that rank).
        Raises when any rank's read failed, once every rank has ended its own."""
        deadline = time.monotonic() + timeout_s
        shards = shards_of(handle)
        if len(shards) != handle.tp_size:
            raise PeerRefused(f"handle {handle.request_id} names {len(shards)} ranks for {handle.tp_size}")
        whole = handle.tp_size == self.size and all(
            s.layout_fingerprint == t.fingerprint for s, t in zip(shards, self.layouts, strict=True)
        )
        if not whole:
            Plan.build(self.cfg, handle.tp_size, self.size)  # refuses before any byte moves
        remote = self.remote if self.size > 1 else None
        seqs = remote.start(handle, into, deadline, whole, self.cfg, self.full) if remote else []
        before, error, state = self.local.nbytes, None, {}
        try:
            state = self.local.read(handle, into, deadline, whole)
        except Exception as exc:  # noqa: BLE001 - raised once every rank has ended its read
            error = exc
        outcomes = remote.wait(seqs, deadline) if remote else []
        self._count(0, self.local.nbytes - before, os.getpid(), {})
        for rank, done in enumerate(outcomes, start=1):
            failed = done if isinstance(done, BaseException) else done.exception(rank)
            error = error or failed
            if not isinstance(done, BaseException) and failed is None:
                self._count(rank, done.nbytes, done.pid, done.by_src)
        if error is not None:
            for rank, (seq, done) in enumerate(zip(seqs, outcomes, strict=True), start=1):
                if isinstance(done, ReadDone) and done.error is None and remote is not None:
                    remote.drop(rank, seq)
            raise error
        out: dict[str, object] = dict(state)
        for rank, (seq, done) in enumerate(zip(seqs, outcomes, strict=True), start=1):
            out.update({f"{name}@{rank}": Held(rank, seq, name) for name in done.names})  # type: ignore[union-attr]
        return out

    def release(self, handle: KVHandle) -> None:
        """End every rank's lease of `handle`: our own server's locally, a peer's over a connection
        of its layout."""
        sharding = None
        for p, shard in enumerate(shards_of(handle)):
            one = shard_handle(handle, shard) if handle.shards else handle
            own = next((t for t in self.direct if t.address == shard.address), None)
            same = next((t for t in self.direct if t.layout.fingerprint == shard.layout_fingerprint), None)
            if own is None and same is None:
                sharding = sharding or Plan.build(self.cfg, handle.tp_size, self.size).src
                same = self.local.peer(sharding.rank_layout(self.full, p), p)
            (own or same).release(one)  # type: ignore[union-attr]

    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        """Handshake with the exporter at `address` now, whatever its tensor-parallel size: with our own
        rank layout first, then with rank 0's layout at each other size the model splits into (up to
        `MAX_PEER_SIZE`); -> the exporter's layout. The first refusal (our own layout's) when none fits."""
        deadline = time.monotonic() + timeout_s
        tried = {self.direct[0].layout.fingerprint}
        try:
            return self.direct[0].check_peer(address, timeout_s)
        except PeerRefused as exc:
            refusal = exc
        for size in range(1, MAX_PEER_SIZE + 1):
            try:
                layout = Plan.build(self.cfg, size, self.size).src.rank_layout(self.full, 0)
            except PeerRefused:
                continue
            if layout.fingerprint in tried:
                continue
            tried.add(layout.fingerprint)
            transport = self.opener(
                torch.empty((1, *layout.block_shape), dtype=torch_dtype(layout.dtype)), layout
            )
            try:
                return transport.check_peer(address, left_s(deadline))
            except PeerRefused:
                continue
            finally:
                transport.close()
        raise refusal

    def rank_parts(self) -> list[RankParts]:
        """Per decode rank: the bytes its own channels fetched from each prefill rank, and the process
        that read them."""
        with self._lock:
            out = [
                msgspec.structs.replace(p, by_prefill_rank=dict(p.by_prefill_rank)) for p in self.remote_parts
            ]
        for p, nbytes in self.local.by_src.items():
            out[0].fetched_bytes += nbytes
            out[0].by_prefill_rank[p] = out[0].by_prefill_rank.get(p, 0) + nbytes
        out[0].pid = os.getpid()
        return out

    def close(self) -> None:
        self.local.close()
        if self.remote is not None:
            self.remote.close()

    def _count(self, rank: int, nbytes: int, pid: int, by_src: dict[int, int]) -> None:
        with self._lock:
            self.rank_bytes[rank] += nbytes
            parts = self.remote_parts[rank]
            parts.pid = pid
            for p, n in by_src.items():
                parts.fetched_bytes += n
                parts.by_prefill_rank[p] = parts.by_prefill_rank.get(p, 0) + n


class TPTransport(KVTransport):
    """The transport of a replica at tensor_parallel_size > 1: one inner transport per rank (`ranks`,
    rank 0's the engine's own pool), exports on every rank, fetches through `ShardedFetch`."""

    def __init__(
        self, full: KVLayout, states: Sequence[Mapping[str, torch.Tensor]], on_free: FreeCallback | None
    ):
        self.layout = full
        self.states = list(states)  # each rank's state tensors [num_slots, *shape] by name
        self.ranks: list[KVTransport] = []
        self.fetcher: ShardedFetch | None = None
        self._on_free = on_free
        self._ended: Counter[tuple[int, ...]] = Counter()
        self._lock = threading.Lock()

    def attach(self, ranks: Sequence[KVTransport], fetcher: ShardedFetch) -> None:
        self.ranks, self.fetcher = list(ranks), fetcher
        self.backend, self.kv_cache, self.stats = ranks[0].backend, ranks[0].kv_cache, ranks[0].stats

    def rank_freed(self, block_ids: list[int]) -> None:
        """One rank's lease ended: the engine frees the blocks when every rank's has."""
        key = tuple(block_ids)
        with self._lock:
            self._ended[key] += 1
            done = self._ended[key] == len(self.ranks)
            if done:
                del self._ended[key]
        if done and self._on_free is not None:
            self._on_free(list(block_ids))

    def export_request(self, request: ExportRequest) -> KVHandle:
        slot = _slot(request.state, self.states[0])
        handles: list[tuple[KVTransport, KVHandle]] = []
        try:
            for rank, transport in enumerate(self.ranks):
                state = _rank_state(request.state, self.states[rank], slot)
                made = transport.export_request(dataclasses.replace(request, state=state))
                handles.append((transport, made))
        except BaseException:
            for transport, done in handles:
                transport.release(done)
            raise
        shards = tuple(KVShard(h.address, h.lease_id, h.layout_fingerprint, h.checksum) for _, h in handles)
        first = handles[0][1]
        return msgspec.structs.replace(
            first,
            layout_fingerprint=self.layout.fingerprint,
            checksum=None,
            tp_size=len(shards),
            shards=shards,
        )

    def release(self, handle: KVHandle) -> None:
        assert self.fetcher is not None
        self.fetcher.release(handle)

    def fetch_request(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        assert self.fetcher is not None
        timeout = request.timeout_s if request.timeout_s is not None else 30.0
        return self.fetcher.fetch(request.handle, request.into_block_ids, timeout)

    def listen(self) -> str:
        return [t.listen() for t in self.ranks][0]

    @property
    def address(self) -> str | None:
        return self.ranks[0].address

    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        assert self.fetcher is not None
        return self.fetcher.check_peer(address, timeout_s)

    def install_faults(self, plan: FaultPlan | None) -> None:
        for t in self.ranks:
            t.install_faults(plan)

    def describe(self) -> TransportInfo:
        group = TensorParallelInfo(
            size=len(self.ranks),
            addresses=[t.address for t in self.ranks],
            served_bytes=[t.stats.snapshot()["counts"].get("served_bytes", 0) for t in self.ranks],
            fetched_bytes=list(self.fetcher.rank_bytes) if self.fetcher else [],
            parts=self.fetcher.rank_parts() if self.fetcher else [],
        )
        return msgspec.structs.replace(
            self.ranks[0].describe(), layout_fingerprint=self.layout.fingerprint, tensor_parallel=group
        )

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()
        for t in self.ranks:
            t.close()


def _slot(state: Mapping[str, torch.Tensor] | None, pool: Mapping[str, torch.Tensor]) -> int | None:
    """The slot of rank 0's pool that an export's state views are; None for state that is not one."""
    if not state:
        return None
    name, view = next(iter(state.items()))
    t = pool[name]
    slot = (view.data_ptr() - t.data_ptr()) // (t[0].numel() * t.element_size())
    return slot if 0 <= slot < t.shape[0] and t[slot].data_ptr() == view.data_ptr() else None


def _rank_state(
    state: Mapping[str, torch.Tensor] | None, pool: Mapping[str, torch.Tensor], slot: int | None
) -> dict[str, torch.Tensor] | None:
    """What one rank exports as state: its own slot's views, or (state that is no slot: a transport
    probe's) a copy of its slot 0, of its own shapes."""
    if not state:
        return None
    return {name: t[slot] if slot is not None else t[0].clone() for name, t in pool.items()}


__all__ = ["Opener", "ShardedFetch", "TPTransport", "shard_handle", "shards_of"]
