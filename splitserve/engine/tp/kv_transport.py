"""KV imports between replicas of different tensor-parallel sizes: the decode side.

Prefill replica at size P (kv_ranks.py): each rank serves its own heads and state channels from its
own process, out of its own pool (rank_exports.py); the handle names P and, per rank, its server's
address, its lease, its layout and the model's KV heads it holds (`KVHandle.shards`), and is stamped
with the model's unsharded layout, so that a decode replica of any size accepts it.

Decode replica at size D (`ShardedFetch`): each decode rank reads its own share in its own process,
into its own pool, straight from the prefill ranks' own servers (rank_reads.py; read_orders.py: rank 0
orders the other ranks' reads and waits for all of them; a failure on any rank fails the fetch):
  - P == D with the same rank layouts: decode rank d fetches prefill rank d's whole shard;
  - otherwise (P > D gathers several prefill ranks into one decode rank, P < D slices one among
    several, a KV head replicated below the rank count is read by each rank that holds it): each
    decode rank reads, from each prefill rank holding some of its heads and state channels, only
    those (a fetch that `select`s runs of heads and channels, kv_routes.py's `parts`), over a channel
    of that prefill rank's layout that is its own, into its own blocks and fresh state tensors
    (`KVChannel.read_part`: tcp and shm stream them, transport/part_sink.py; cuda_ipc's GPU copies
    them out of the exporter's mapped pool, transport/gpu/cuda_ipc_part.py): every byte crosses once,
    and each rank's counters show its own share. nccl and nixl move whole blocks only: across sizes
    they are refused before any byte moves, at the peer check and at the fetch (config/kv_backends.py).
    A size pair the model cannot be split into, or a handle whose ranks hold other heads than that
    size puts on them, is refused before any byte moves, naming both sizes; a rank layout the
    exporter does not have is refused by its handshake, in the same words.
The state decode ranks 1..D-1 read stays in their processes; it comes back as `name@rank` keys holding
a `Held`, which the engine's state pool sends with the next step (journal.py's "put").
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Sequence

import msgspec
import torch

from splitserve.config.kv_backends import across_sizes_refusal
from splitserve.engine.tp.kv_routes import Plan, Sharding
from splitserve.engine.tp.rank_reads import (
    Held,
    Opener,
    RankReader,
    fetch_only_kv,
    left_s,
    shard_handle,
    shards_of,
)
from splitserve.engine.tp.read_orders import ReadDone, RemoteReads
from splitserve.model.config import ModelConfig
from splitserve.transport.errors import PeerRefused
from splitserve.transport.layout import KVLayout
from splitserve.transport.transport import KVTransport
from splitserve.wire.kv_handle import KVHandle, KVShard
from splitserve.wire.transport_info import RankParts

log = logging.getLogger(__name__)

MAX_PEER_SIZE = 8  # the largest exporter size `check_peer` tries


class ShardedFetch:
    """Decode side of a replica at `size`: fill our ranks' pools from a handle of any exporter size
    (rank 0's here, through `own`, the transport over its pool; each other rank's in that rank's
    process: rank_reads.py), and release such handles (each rank's lease at that rank's server)."""

    def __init__(
        self,
        cfg: ModelConfig,
        full: KVLayout,
        kv: torch.Tensor,
        own: KVTransport,
        size: int,
        opener: Opener,
        remote: RemoteReads | None = None,
    ) -> None:
        self.cfg, self.full, self.own, self.opener, self.remote = cfg, full, own, opener, remote
        self.size = size
        self.local = RankReader(cfg, full, 0, self.size, kv, opener, own=own)
        self.layouts = [Sharding.of(cfg, self.size).rank_layout(full, r) for r in range(self.size)]
        self.rank_bytes = [0] * self.size  # KV and state bytes written into each rank's pool
        self.remote_parts = [RankParts() for _ in range(self.size)]  # ranks 1.., from their outcomes
        self._plans: dict[int, Plan] = {}  # by exporter size
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
        check_heads(self._plan(handle.tp_size), shards)  # before any byte moves
        whole = handle.tp_size == self.size and all(
            s.layout_fingerprint == t.fingerprint for s, t in zip(shards, self.layouts, strict=True)
        )
        refusal = None if whole else across_sizes_refusal(self.own.backend, handle.tp_size, self.size)
        if refusal:
            raise PeerRefused(refusal, [f"handle {handle.request_id}: prefill ranks {handle.tp_size}"])
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
        """End every rank's lease of `handle` at that rank's server (over a connection of its layout),
        each rank's whatever became of the others'; the first failure is raised after."""
        sharding, error = None, None
        for p, shard in enumerate(shards_of(handle)):
            one = shard_handle(handle, shard) if handle.shards else handle
            try:
                if (
                    self.own.address == shard.address
                    or self.own.layout.fingerprint == shard.layout_fingerprint
                ):
                    self.own.release(one)
                    continue
                sharding = sharding or Plan.build(self.cfg, handle.tp_size, self.size).src
                self.local.peer(sharding.rank_layout(self.full, p), p).release(one)
            except Exception as exc:  # noqa: BLE001 - the other ranks' leases end all the same
                log.warning("releasing prefill rank %d's lease of %s failed: %s", p, handle.request_id, exc)
                error = error or exc
        if error is not None:
            raise error

    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        """Handshake with the exporter at `address` now, whatever its tensor-parallel size: with our own
        rank layout first, then with rank 0's layout at each other size the model splits into (up to
        `MAX_PEER_SIZE`); -> the exporter's layout. The first refusal (our own layout's) when none fits."""
        deadline = time.monotonic() + timeout_s
        tried = {self.own.layout.fingerprint}
        try:
            return self.own.check_peer(address, timeout_s)
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
            transport = self.opener(fetch_only_kv(layout, self.local.kv.device), layout)
            try:
                found = transport.check_peer(address, left_s(deadline))
            except PeerRefused:
                continue
            finally:
                transport.close()
            across = across_sizes_refusal(self.own.backend, size, self.size)
            if across:  # a peer we could read, but not over this backend: say so now, not at a fetch
                raise PeerRefused(across, [f"exporter {address}: rank 0 of tensor_parallel_size {size}"])
            return found
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

    def _plan(self, prefill_size: int) -> Plan:
        """How our ranks are filled from an exporter of `prefill_size` (PeerRefused if they cannot be)."""
        plan = self._plans.get(prefill_size)
        if plan is None:
            plan = self._plans[prefill_size] = Plan.build(self.cfg, prefill_size, self.size)
        return plan

    def _count(self, rank: int, nbytes: int, pid: int, by_src: dict[int, int]) -> None:
        with self._lock:
            self.rank_bytes[rank] += nbytes
            parts = self.remote_parts[rank]
            parts.pid = pid
            for p, n in by_src.items():
                parts.fetched_bytes += n
                parts.by_prefill_rank[p] = parts.by_prefill_rank.get(p, 0) + n


def check_heads(plan: Plan, shards: Sequence[KVShard]) -> None:
    """Refuse a handle whose ranks say they hold other KV heads than its size puts on them."""
    for p, shard in enumerate(shards):
        if shard.kv_heads and list(shard.kv_heads) != plan.src.kv[p]:
            raise PeerRefused(
                f"cannot map a prefill replica at tensor_parallel_size {plan.src.size} onto a decode "
                f"replica at tensor_parallel_size {plan.dst.size}",
                [f"prefill rank {p} serves KV heads {list(shard.kv_heads)}, not {plan.src.kv[p]}"],
            )


__all__ = ["MAX_PEER_SIZE", "Opener", "ShardedFetch", "check_heads", "shard_handle", "shards_of"]
