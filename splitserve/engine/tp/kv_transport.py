"""KV transfer between replicas of different tensor-parallel sizes.

Prefill replica at size P: one transport (and server) per rank, each over that rank's own pool, all
in rank 0's process (the pools of ranks 1..P-1 are shared memory it maps: pools.py). An export leases
the request's blocks and copies its state on every rank; the handle names P and each rank's address,
lease and layout (`KVHandle.shards`), and is stamped with the model's unsharded layout, so that a
decode replica of any size accepts it. The engine's blocks are freed once every rank's lease ended.

Decode replica at size D (`ShardedFetch`):
  - P == D with the same rank layouts: decode rank d fetches prefill rank d's shard straight into
    its own pool, for every d (no staging);
  - otherwise (P > D gathers several prefill ranks into one decode rank, P < D slices one among
    several, a KV head replicated below the rank count is read by each rank that holds it): each
    decode rank reads, from each prefill rank holding some of its heads and state channels, only
    those (a fetch that `select`s runs of heads and channels, kv_routes.py's `parts`), straight into
    its own blocks and fresh state tensors, over a channel of that prefill rank's layout that is its
    own: no staging buffer, every byte moves once, and each rank's counters show its own share. A
    size pair the model cannot be split into is refused before any byte moves, naming both sizes;
    a rank layout the exporter does not have is refused by its handshake, with the same words.
The state of decode ranks 1..D-1 comes back under `name@rank` keys; the engine's state pool hands it
to those ranks with the next step (journal.py's "put").
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence

import msgspec
import torch

from splitserve.engine.tp.kv_routes import Plan, parts
from splitserve.model.config import ModelConfig
from splitserve.transport.errors import PeerRefused, TransferTimeout
from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.layout import KVLayout, torch_dtype
from splitserve.transport.lease import FreeCallback
from splitserve.transport.payload import ByteStream, channel_pieces, empty_state, head_pieces, tensor_bytes
from splitserve.transport.transport import ExportRequest, FetchRequest, KVTransport
from splitserve.wire.kv_handle import KVHandle, KVShard
from splitserve.wire.transport_info import RankParts, TensorParallelInfo, TransportInfo

MAX_PEER_SIZE = 8  # the largest exporter size `check_peer` tries

# a fetch-only transport over a tensor with the given layout (the connector's backend and secret)
Opener = Callable[[torch.Tensor, KVLayout], KVTransport]


def shards_of(handle: KVHandle) -> tuple[KVShard, ...]:
    if handle.shards:
        return handle.shards
    return (KVShard(handle.address, handle.lease_id, handle.layout_fingerprint, handle.checksum),)


def shard_handle(handle: KVHandle, shard: KVShard) -> KVHandle:
    """One rank's part of `handle`, as a plain handle its transport fetches and releases by."""
    return msgspec.structs.replace(
        handle, address=shard.address, lease_id=shard.lease_id, layout_fingerprint=shard.layout_fingerprint,
        checksum=shard.checksum, tp_size=1, shards=(),
    )  # fmt: skip


class ShardedFetch:
    """Decode side: fill our ranks' pools (`kvs`, rank order) from a handle of any exporter size, and
    release such handles (each rank's lease through a connection of that rank's layout)."""

    def __init__(
        self,
        cfg: ModelConfig,
        full: KVLayout,
        kvs: Sequence[torch.Tensor],
        direct: Sequence[KVTransport],
        opener: Opener,
    ) -> None:
        self.cfg, self.full, self.kvs, self.direct, self.opener = cfg, full, list(kvs), list(direct), opener
        self.rank_bytes = [0] * len(self.kvs)  # KV and state bytes written into each rank's pool
        # (prefill rank's layout fingerprint, prefill rank, decode rank) -> the decode rank's fetch-only
        # channel of that layout (its connections, its counters)
        self.peers: dict[tuple[str, int, int], KVTransport] = {}
        self._lock = threading.Lock()

    def fetch(self, handle: KVHandle, into: Sequence[int], timeout_s: float) -> dict[str, torch.Tensor]:
        deadline = time.monotonic() + timeout_s
        shards, size = shards_of(handle), len(self.kvs)
        if len(shards) != handle.tp_size:
            raise PeerRefused(f"handle {handle.request_id} names {len(shards)} ranks for {handle.tp_size}")
        if handle.tp_size == size and all(
            s.layout_fingerprint == t.layout.fingerprint for s, t in zip(shards, self.direct, strict=True)
        ):
            return self._direct(handle, shards, into, deadline)
        plan = Plan.build(self.cfg, handle.tp_size, size)  # refuses before any byte moves
        return self._by_parts(handle, shards, list(into), plan, deadline)

    def release(self, handle: KVHandle) -> None:
        """End every rank's lease of `handle`: our own server's locally, a peer's over a connection
        of its layout."""
        sharding = None
        for p, shard in enumerate(shards_of(handle)):
            one = shard_handle(handle, shard) if handle.shards else handle
            own = next((t for t in self.direct if t.address == shard.address), None)
            same = next((t for t in self.direct if t.layout.fingerprint == shard.layout_fingerprint), None)
            if own is None and same is None:
                sharding = sharding or Plan.build(self.cfg, handle.tp_size, len(self.kvs)).src
                same = self._peer(sharding.rank_layout(self.full, p), p, 0)
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
            refused = exc
        for size in range(1, MAX_PEER_SIZE + 1):
            try:
                layout = Plan.build(self.cfg, size, len(self.kvs)).src.rank_layout(self.full, 0)
            except PeerRefused:
                continue
            if layout.fingerprint in tried:
                continue
            tried.add(layout.fingerprint)
            transport = self._open(layout)
            try:
                return transport.check_peer(address, _left(deadline))
            except PeerRefused:
                continue
            finally:
                transport.close()
        raise refused

    def rank_parts(self) -> list[RankParts]:
        """Per decode rank: the bytes its own channels fetched from each prefill rank."""
        out = [RankParts() for _ in self.kvs]
        with self._lock:
            peers = list(self.peers.items())
        for (_, p, d), t in peers:
            nbytes = int(t.stats.snapshot()["counts"].get("fetched_bytes", 0))
            out[d].fetched_bytes += nbytes
            out[d].by_prefill_rank[p] = out[d].by_prefill_rank.get(p, 0) + nbytes
        return out

    def close(self) -> None:
        with self._lock:
            peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            peer.close()

    def _open(self, layout: KVLayout) -> KVTransport:
        """A fetch-only channel of `layout` (its own pool is one unused block: it fetches parts only)."""
        return self.opener(torch.empty((1, *layout.block_shape), dtype=torch_dtype(layout.dtype)), layout)

    def _peer(self, layout: KVLayout, src: int, rank: int) -> KVTransport:
        key = (layout.fingerprint, src, rank)
        with self._lock:
            if key in self.peers:
                return self.peers[key]
        made = self._open(layout)  # NOTE: not under the lock (the opener reads our describe())
        with self._lock:
            peer = self.peers.setdefault(key, made)
        if peer is not made:
            made.close()
        return peer

    def _direct(
        self, handle: KVHandle, shards: Sequence[KVShard], into: Sequence[int], deadline: float
    ) -> dict[str, torch.Tensor]:
        out: dict[str, torch.Tensor] = {}
        for rank, (shard, transport) in enumerate(zip(shards, self.direct, strict=True)):
            state = transport.fetch(shard_handle(handle, shard), into, _left(deadline))
            out.update({name if rank == 0 else f"{name}@{rank}": t for name, t in state.items()})
            self._count(rank, transport.layout.payload_nbytes(len(into)))
        return out

    def _by_parts(
        self, handle: KVHandle, shards: Sequence[KVShard], into: list[int], plan: Plan, deadline: float
    ) -> dict[str, torch.Tensor]:
        """Each decode rank reads its own heads and state channels from each prefill rank that holds
        them, straight into its pool and fresh state tensors (no staging: every byte moves once)."""
        out: dict[str, torch.Tensor] = {}
        for rank, kv in enumerate(self.kvs):
            layout = plan.dst.rank_layout(self.full, rank)
            rows = tensor_bytes(kv).reshape(kv.shape[0], -1)  # [num_blocks, block_nbytes]
            state = empty_state(layout)
            for part in parts(plan, rank):
                peer = self._peer(plan.src.rank_layout(self.full, part.src), part.src, rank)
                dst = ByteStream(
                    head_pieces(rows, layout, into, part.heads) + channel_pieces(state, part.states)
                )
                request = FetchRequest(shard_handle(handle, shards[part.src]), into, _left(deadline))
                try:
                    peer.fetch_part(request, part.select, dst)  # type: ignore[attr-defined]  # a KVChannel
                except PeerRefused as exc:
                    raise PeerRefused(
                        f"cannot map a prefill replica at tensor_parallel_size {plan.src.size} onto a "
                        f"decode replica at tensor_parallel_size {plan.dst.size}",
                        exc.mismatches or [str(exc)],
                    ) from None
                self._count(rank, dst.nbytes)
            out.update({name if rank == 0 else f"{name}@{rank}": t for name, t in state.items()})
        return out

    def _count(self, rank: int, nbytes: int) -> None:
        with self._lock:
            self.rank_bytes[rank] += nbytes


def _left(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout("the fetch deadline passed between the ranks' parts")
    return left


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
