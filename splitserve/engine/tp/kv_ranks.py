"""The KV transport of an engine at tensor_parallel_size > 1, as rank 0's process holds it.

Every rank serves its own share of an export from its own process, out of its own pool: rank 0 over
the engine's transport, rank r > 0 over a transport it opens in its own process on rank 0's order
(rank_exports.py; `RemoteRank` is rank 0's handle on it). `TPTransport` joins them: an export leases
the request's blocks and copies its state on every rank at once, and its handle names each rank's own
server (`KVHandle.shards`); the engine frees the blocks once every rank's lease of them ended. Imports
are read by each rank in its own process too (kv_transport.py's `ShardedFetch`, rank_reads.py).

On CUDA each rank's transport is the configured backend over that rank's device pool, as at size 1.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import msgspec
import torch

from splitserve.engine.tp.kv_routes import Sharding
from splitserve.engine.tp.kv_transport import Opener, ShardedFetch
from splitserve.engine.tp.rank_exports import ExportDone, ExportOrder, rank_state, shard_of
from splitserve.engine.tp.read_orders import Reach, RemoteReads
from splitserve.model.config import ModelConfig
from splitserve.transport.errors import TransportError
from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.layout import KVLayout
from splitserve.transport.lease import FreeCallback
from splitserve.transport.transport import ExportRequest, FetchRequest, KVTransport
from splitserve.wire.kv_handle import KVHandle, KVShard
from splitserve.wire.transport_info import LeaseCounts, TensorParallelInfo, TransportInfo

if TYPE_CHECKING:
    from splitserve.engine.engine import LLMEngine

OPEN_TIMEOUT_S = 120.0  # a rank's exporter opens within this (the rank connects once it has built)
ORDER_TIMEOUT_S = 30.0  # a rank answers an export, release or fault order within this
DESCRIBE_TIMEOUT_S = 2.0  # a rank that does not describe itself within this shows as silent

# (a rank's kv cache, its layout, on_free) -> that rank's transport
Maker = Callable[[torch.Tensor, KVLayout, FreeCallback | None], KVTransport]


class RemoteRank:
    """Rank 0's handle on rank `rank`'s exporter, which runs in that rank's process."""

    def __init__(self, rank: int, remote: RemoteReads) -> None:
        self.rank, self.remote = rank, remote
        self.address: str | None = None
        self.pid = 0  # the process that serves this rank's exports

    def ask(self, deadline: float, **fields: object) -> int:
        return self.remote.ask(self.rank, lambda seq: ExportOrder(seq, **fields), deadline)  # type: ignore[arg-type]

    def answer(self, seq: int, deadline: float) -> ExportDone:
        done = self.remote.answer(self.rank, seq, deadline)
        if isinstance(done, BaseException):
            raise done
        if done.error is not None:
            kind, message = done.error
            raise TransportError(f"tensor-parallel rank {self.rank}'s exporter failed ({kind}: {message})")
        self.pid = done.pid
        return done

    def call(self, timeout_s: float, **fields: object) -> ExportDone:
        deadline = time.monotonic() + timeout_s
        return self.answer(self.ask(deadline, **fields), deadline)

    def release(self, handle: KVHandle) -> None:
        self.call(ORDER_TIMEOUT_S, op="release", handle=handle)

    def install_faults(self, plan: FaultPlan | None) -> None:
        self.call(ORDER_TIMEOUT_S, op="faults", knobs=plan.knobs if plan is not None else None)

    def describe(self) -> TransportInfo | None:
        """This rank's transport as it describes itself; None when it does not answer."""
        try:
            return self.call(DESCRIBE_TIMEOUT_S, op="describe").info
        except TransportError:
            return None


class TPTransport(KVTransport):
    """The transport of a replica at tensor_parallel_size > 1: rank 0's own (`local`, over the engine's
    pool), the other ranks' exporters (`remote`, each in its rank's process), fetches through
    `ShardedFetch`. `ranks` lists them in rank order."""

    def __init__(self, full: KVLayout, states: Mapping[str, torch.Tensor], on_free: FreeCallback | None):
        self.layout = full
        self.states = states  # rank 0's state tensors [num_slots, *shape] by name
        self.ranks: list[KVTransport | RemoteRank] = []
        self.kv_heads: tuple[int, ...] = ()
        self.fetcher: ShardedFetch | None = None
        self._on_free = on_free
        self._ended: Counter[tuple[int, ...]] = Counter()
        self._lock = threading.Lock()

    def attach(
        self, local: KVTransport, remote: list[RemoteRank], fetcher: ShardedFetch, kv_heads: Sequence[int]
    ) -> None:
        self.local, self.remote, self.fetcher, self.kv_heads = local, remote, fetcher, tuple(kv_heads)
        self.ranks = [local, *remote]
        self.backend, self.kv_cache, self.stats = local.backend, local.kv_cache, local.stats

    def rank_freed(self, block_ids: list[int]) -> None:
        """One rank's lease ended: the engine frees the blocks when every rank's has."""
        self._count(tuple(block_ids), 1)

    def _count(self, key: tuple[int, ...], n: int) -> None:
        with self._lock:
            self._ended[key] += n
            done = self._ended[key] == len(self.ranks)
            if done or self._ended[key] == 0:
                del self._ended[key]
        if done and self._on_free is not None:
            self._on_free(list(key))

    def export_request(self, request: ExportRequest) -> KVHandle:
        """Every rank leases the blocks and copies its state at once (the others in their processes,
        while this one does its own); a failure on any rank ends the leases the others made."""
        deadline = time.monotonic() + ORDER_TIMEOUT_S
        slot, with_state = _slot(request.state, self.states), bool(request.state)
        asked: list[tuple[RemoteRank, int]] = []
        error: BaseException | None = None
        made: KVHandle | None = None
        fields = {"request_id": request.request_id, "block_ids": tuple(request.block_ids),
                  "num_tokens": request.num_tokens, "with_state": with_state, "slot": slot}  # fmt: skip
        try:
            for rank in self.remote:
                asked.append((rank, rank.ask(deadline, op="export", **fields)))
            state = rank_state(self.states, with_state, slot)
            made = self.local.export_request(dataclasses.replace(request, state=state))
        except BaseException as exc:  # noqa: BLE001 - raised once every rank asked has answered
            error = exc
        shards: list[tuple[RemoteRank, KVShard]] = []
        for rank, seq in asked:
            try:
                shards.append((rank, rank.answer(seq, deadline).shard))  # type: ignore[arg-type]
            except BaseException as exc:  # noqa: BLE001
                error = error or exc
        if error is not None:
            self._undo(request, made, shards)
            raise error
        assert made is not None
        first = shard_of(made, 0, self.kv_heads)
        return msgspec.structs.replace(
            made, layout_fingerprint=self.layout.fingerprint, checksum=None, tp_size=len(self.ranks),
            shards=(first, *(shard for _, shard in shards)),
        )  # fmt: skip

    def _undo(
        self, request: ExportRequest, made: KVHandle | None, shards: list[tuple[RemoteRank, KVShard]]
    ) -> None:
        """End the leases a failed export made; their ends count for nothing (the engine frees the
        blocks of a failed export itself)."""
        self._count(tuple(request.block_ids), -(len(shards) + (made is not None)))
        if made is not None:
            self.local.release(made)
        for rank, shard in shards:
            one = KVHandle(
                self.backend, shard.address, request.request_id, shard.lease_id, tuple(request.block_ids),
                request.num_tokens, shard.layout_fingerprint, 0.0,
            )  # fmt: skip
            with contextlib.suppress(TransportError):  # a rank that is gone holds no lease
                rank.release(one)

    def release(self, handle: KVHandle) -> None:
        assert self.fetcher is not None
        self.fetcher.release(handle)

    def fetch_request(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        assert self.fetcher is not None
        timeout = request.timeout_s if request.timeout_s is not None else 30.0
        return self.fetcher.fetch(request.handle, request.into_block_ids, timeout)

    def listen(self) -> str:
        return self.local.listen()

    @property
    def address(self) -> str | None:
        return self.local.address

    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        assert self.fetcher is not None
        return self.fetcher.check_peer(address, timeout_s)

    def install_faults(self, plan: FaultPlan | None) -> None:
        for t in self.ranks:
            t.install_faults(plan)

    def describe(self) -> TransportInfo:
        """Rank 0's description, its leases summed over every rank, and each rank's part."""
        infos = [self.local.describe(), *(r.describe() for r in self.remote)]
        leases = [i.leases if i is not None else LeaseCounts(0) for i in infos]
        group = TensorParallelInfo(
            size=len(self.ranks),
            addresses=[self.local.address, *(r.address for r in self.remote)],
            served_bytes=[i.counts.get("served_bytes", 0) if i is not None else 0 for i in infos],
            fetched_bytes=list(self.fetcher.rank_bytes) if self.fetcher else [],
            parts=self.fetcher.rank_parts() if self.fetcher else [],
            served_pids=[os.getpid(), *(r.pid for r in self.remote)],
            leases_active=[c.active for c in leases],
        )
        total = LeaseCounts(
            *(sum(getattr(c, f) for c in leases) for f in ("active", "granted", "released", "expired"))
        )
        return msgspec.structs.replace(
            infos[0], layout_fingerprint=self.layout.fingerprint, leases=total, tensor_parallel=group
        )

    def close(self) -> None:
        if self.fetcher is not None:
            self.fetcher.close()  # closes the ranks' order connections: each closes its exporter
        self.local.close()


def open_ranks(
    engine: LLMEngine,
    full: KVLayout,
    cfg: ModelConfig,
    make: Maker,
    opener: Opener,
    on_free: FreeCallback,
    reach: Callable[[], Reach],
) -> TPTransport:
    """The transport of `engine` (rank 0 of its group): rank 0's own over its pool, every other rank's
    opened in that rank's process, each on its own listener; imports read by each rank in its own
    process (`reach`: the backend, secret and options the other ranks open their channels with)."""
    group = engine.runner.group  # type: ignore[attr-defined]  # a TPRunner
    sharding = Sharding.of(cfg, group.size)
    tp = TPTransport(full, engine.states.states, on_free)
    local = make(engine.kv_cache, sharding.rank_layout(full, 0), tp.rank_freed)
    remote = RemoteReads(group.store, group.size, reach)
    remote.on_freed = tp.rank_freed
    ranks = [RemoteRank(r, remote) for r in range(1, group.size)]
    try:
        opened = dataclasses.replace(reach(), backend=local.backend)  # after any fallback
        deadline = time.monotonic() + OPEN_TIMEOUT_S
        seqs = [
            rank.ask(
                deadline,
                op="open",
                reach=opened,
                layout=sharding.rank_layout(full, rank.rank),
                kv_heads=tuple(sharding.kv[rank.rank]),
            )
            for rank in ranks
        ]
        for rank, seq in zip(ranks, seqs, strict=True):
            rank.address = rank.answer(seq, deadline).address
    except BaseException:
        remote.close()
        local.close()
        raise
    fetcher = ShardedFetch(cfg, full, engine.kv_cache, local, group.size, opener, remote)
    tp.attach(local, ranks, fetcher, sharding.kv[0])
    return tp


def _slot(state: Mapping[str, torch.Tensor] | None, pool: Mapping[str, torch.Tensor]) -> int | None:
    """The slot of rank 0's pool that an export's state views are; None for state that is not one."""
    if not state:
        return None
    name, view = next(iter(state.items()))
    t = pool[name]
    slot = (view.data_ptr() - t.data_ptr()) // (t[0].numel() * t.element_size())
    return slot if 0 <= slot < t.shape[0] and t[slot].data_ptr() == view.data_ptr() else None


__all__ = ["Maker", "RemoteRank", "TPTransport", "open_ranks"]
