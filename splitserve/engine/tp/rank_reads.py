"""One decode rank's reads of an imported request, in that rank's own process, into its own pool.

A decode replica at tensor_parallel_size D fills rank d's pool from the exporter ranks that hold its
heads and state channels (kv_routes.py's `parts`), or, at the exporter's own size and rank layouts,
from its twin rank's whole shard. The reads run where the pool lives (`RankReader`): rank 0's in its
process, every other rank's in that rank's process on rank 0's order (read_orders.py).

The state channels rank r > 0 reads stay in its process (`HELD`) until the step that hands the request
its slot: rank 0's journal carries a `Held` in place of the tensor (journal.py's "put").
"""

from __future__ import annotations

import dataclasses
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import msgspec
import torch

from splitserve.engine.tp.kv_routes import Plan, Sharding, parts
from splitserve.model.config import ModelConfig
from splitserve.transport.errors import PeerRefused, TransferTimeout
from splitserve.transport.layout import KVLayout, torch_dtype
from splitserve.transport.part_sink import PartTarget
from splitserve.transport.transport import FetchRequest, KVTransport, TransportOptions
from splitserve.wire.kv_handle import KVHandle, KVShard

Opener = Callable[[torch.Tensor, KVLayout], KVTransport]  # a fetch-only transport over a tensor
# Read state no step took: that of a probe's fetch, or of an import that failed after the reads. An
# import's is taken by the step after its reads end (milliseconds); what is older than this goes.
HELD_TTL_S = 300.0
HELD: dict[int, dict[str, torch.Tensor]] = {}  # rank r's read state by order seq, until its "put"
_held_at: dict[int, float] = {}  # when each entry of HELD was read
_held_lock = threading.Lock()


def shards_of(handle: KVHandle) -> tuple[KVShard, ...]:
    if handle.shards:
        return handle.shards
    return (KVShard(handle.address, handle.lease_id, handle.layout_fingerprint, handle.checksum),)


def shard_handle(handle: KVHandle, shard: KVShard) -> KVHandle:
    """One rank's part of `handle`, as a plain handle its transport fetches and releases by. The
    handle's lease board slot and state arena row (cuda_ipc) are rank 0's: another rank's shard has
    none (its fetch asks that rank's exporter, whose answer names its own row)."""
    own = shard.lease_id == handle.lease_id and shard.address == handle.address
    return msgspec.structs.replace(
        handle, address=shard.address, lease_id=shard.lease_id, layout_fingerprint=shard.layout_fingerprint,
        checksum=shard.checksum, tp_size=1, shards=(), lease_slot=handle.lease_slot if own else None,
        state_row=handle.state_row if own else None,
    )  # fmt: skip


def fetch_only(options: TransportOptions) -> TransportOptions:
    """The options of a channel that only fetches (an `Opener`'s): no GPU rows kept for exports' state."""
    return dataclasses.replace(options, state_arena_rows=0)


def left_s(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout("the fetch deadline passed between the ranks' parts")
    return left


def refused(plan: Plan, exc: PeerRefused) -> PeerRefused:
    return PeerRefused(
        f"cannot map a prefill replica at tensor_parallel_size {plan.src.size} onto a decode replica "
        f"at tensor_parallel_size {plan.dst.size}",
        exc.mismatches or [str(exc)],
    )


class RankReader:
    """Decode rank `rank`'s reads into its pool `kv`, over channels of its own: one per prefill rank
    and layout for parts (a fetch-only channel: one unused block on the rank's device, nothing
    staged; `read_part` streams a part in or copies it on the device), and `own` (a channel over the
    pool itself) for whole shards."""

    def __init__(
        self, cfg: ModelConfig, full: KVLayout, rank: int, size: int, kv: torch.Tensor, opener: Opener,
        own: KVTransport | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.full, self.rank, self.size, self.kv, self.opener = cfg, full, rank, size, kv, opener
        self.layout = Sharding.of(cfg, size).rank_layout(full, rank)
        self.own = own
        self.peers: dict[tuple[str, int], KVTransport] = {}  # (layout fingerprint, prefill rank) -> channel
        self.by_src: Counter[int] = Counter()  # bytes the reads took from each prefill rank
        self.nbytes = 0  # every byte written into this rank's pool and state
        self._lock = threading.Lock()

    def read(self, handle: KVHandle, into: Sequence[int], deadline: float, whole: bool) -> dict:
        """Fill our blocks `into` (and fresh state tensors, returned) with our share of `handle`."""
        shards = shards_of(handle)
        if whole:
            if self.own is None:
                self.own = self.opener(self.kv, self.layout)
            state = self.own.fetch(shard_handle(handle, shards[self.rank]), into, left_s(deadline))
            self._count(self.rank, self.layout.payload_nbytes(len(into)))  # its twin prefill rank
            return state
        plan = Plan.build(self.cfg, handle.tp_size, self.size)
        reads = [
            (part, self.peer(plan.src.rank_layout(self.full, part.src), part.src))
            for part in parts(plan, self.rank)
        ]
        # fresh state tensors where the channels put them: the rank's device for cuda_ipc's device copy
        cpu = torch.device("cpu")
        device = getattr(reads[0][1], "part_state_device", cpu) if reads else cpu
        state = {name: torch.empty(shape, dtype=torch_dtype(dtype), device=device)
                 for name, shape, dtype in self.layout.state_shapes}  # fmt: skip
        for part, peer in reads:
            target = PartTarget(self.kv, self.layout, into, part.heads, state, part.states)
            request = FetchRequest(shard_handle(handle, shards[part.src]), into, left_s(deadline))
            try:
                nbytes = peer.read_part(request, part.select, target)  # type: ignore[attr-defined]
            except PeerRefused as exc:
                raise refused(plan, exc) from None
            self._count(part.src, nbytes)
        return state

    def peer(self, layout: KVLayout, src: int) -> KVTransport:
        key = (layout.fingerprint, src)
        with self._lock:
            if key in self.peers:
                return self.peers[key]
        # NOTE: not under the lock (an opener may read describe())
        made = self.opener(fetch_only_kv(layout, self.kv.device), layout)
        with self._lock:
            peer = self.peers.setdefault(key, made)
        if peer is not made:
            made.close()
        return peer

    def _count(self, src: int | None, nbytes: int) -> None:
        with self._lock:
            self.nbytes += nbytes
            if src is not None:
                self.by_src[src] += nbytes

    def close(self) -> None:
        with self._lock:
            peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            peer.close()


def fetch_only_kv(layout: KVLayout, device: torch.device) -> torch.Tensor:
    """The KV a fetch-only channel is opened over: one unused block of `layout`, on the reading rank's
    device (a GPU backend's channel lives on the GPU it copies into)."""
    return torch.empty((1, *layout.block_shape), dtype=torch_dtype(layout.dtype), device=device)


@dataclass(frozen=True)
class Held:
    """In rank 0's journal, in place of a state tensor: the one rank `rank` read for order `seq`."""

    rank: int
    seq: int
    name: str


def keep(seq: int, state: dict[str, torch.Tensor]) -> None:
    """Hold the state this rank read for order `seq` until its "put" (or `HELD_TTL_S`)."""
    now = time.monotonic()
    with _held_lock:
        while _held_at and now - next(iter(_held_at.values())) > HELD_TTL_S:
            oldest = next(iter(_held_at))  # (insertion order is time order)
            del _held_at[oldest]
            HELD.pop(oldest, None)
        HELD[seq], _held_at[seq] = state, now


def drop(seq: int) -> None:
    with _held_lock:
        HELD.pop(seq, None)
        _held_at.pop(seq, None)


def held_tensor(t: torch.Tensor | Held) -> torch.Tensor:
    """A journal's state tensor, taking a `Held` one out of this rank's `HELD`."""
    if isinstance(t, torch.Tensor):
        return t
    with _held_lock:
        state = HELD.get(t.seq, {})
        if t.name not in state:
            raise RuntimeError(f"decode rank {t.rank} holds no state {t.name!r} of read {t.seq}")
        out = state.pop(t.name)
        if not state:
            HELD.pop(t.seq, None)
            _held_at.pop(t.seq, None)
    return out


__all__ = [
    "HELD",
    "HELD_TTL_S",
    "Held",
    "Opener",
    "RankReader",
    "drop",
    "fetch_only",
    "fetch_only_kv",
    "held_tensor",
    "keep",
    "left_s",
    "shard_handle",
    "shards_of",
]
