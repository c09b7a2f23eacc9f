"""Which rank holds which KV heads and state channels, at two tensor-parallel sizes, and the copies that
carry one layout into the other.

A rank's KV cache holds some of the model's KV heads (a contiguous run, or one shared head when the
model has fewer KV heads than ranks), and a hybrid model's state tensors some of its Gated DeltaNet
channels (model/parallel.py: `kv_head_index`, `state_index`). Moving a request from a prefill replica at
size P to a decode replica at size D is, per decode rank, a list of `Route`s: from prefill rank p, the
positions `src` along the split axis go to positions `dst` of this rank's tensor.

    plan = Plan.build(cfg, prefill_size, decode_size)   # PeerRefused if the sizes cannot be mapped
    plan.needed                                          # the prefill ranks any decode rank reads
    scatter_blocks(plan.kv[d], staged, kv_d, into_ids)   # staged[p]: [n, L, 2, bs, heads_p, D]
    plan.state(d, name, staged_states, shape)            # one decode rank's state tensor
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

import torch

from splitserve.model.config import ModelConfig
from splitserve.model.parallel import check_divisible, kv_head_index, state_index
from splitserve.transport.errors import PeerRefused
from splitserve.transport.layout import KVLayout

KV_AXIS = 3  # of one block [L, 2, block_size, heads, head_dim]


@dataclass(frozen=True)
class Sharding:
    """Where a model's KV heads and state channels sit at one tensor-parallel size, rank by rank."""

    size: int
    kv: list[list[int]]
    states: dict[str, tuple[int, list[list[int]], int]]  # name -> (axis, channels per rank, model's count)

    @classmethod
    def of(cls, cfg: ModelConfig, size: int) -> Sharding:
        check_divisible(cfg, size)
        per_rank = [state_index(cfg, size, r) for r in range(size)]
        states = {
            name: (axis, [ranks[name][1] for ranks in per_rank], count)
            for name, (axis, _, count) in per_rank[0].items()
        }
        return cls(size, [kv_head_index(cfg, size, r) for r in range(size)], states)

    def rank_layout(self, full: KVLayout, rank: int) -> KVLayout:
        """Rank `rank`'s layout, from the model's unsharded one."""
        shapes = []
        for name, shape, dtype in full.state_shapes:
            axis, channels, _ = self.states[name]
            dims = list(shape)
            dims[axis] = len(channels[rank])
            shapes.append((name, tuple(dims), dtype))
        return replace(full, num_kv_heads=len(self.kv[rank]), state_shapes=tuple(shapes))

    def full_layout(self, rank0: KVLayout, num_kv_heads: int) -> KVLayout:
        """The model's unsharded layout, from rank 0's (what handles of every size are stamped with)."""
        shapes = []
        for name, shape, dtype in rank0.state_shapes:
            axis, _, count = self.states[name]
            dims = list(shape)
            dims[axis] = count
            shapes.append((name, tuple(dims), dtype))
        return replace(rank0, num_kv_heads=num_kv_heads, state_shapes=tuple(shapes))


@dataclass(frozen=True)
class Route:
    """From source rank `src`, positions `src_pos` along the split axis -> our positions `dst_pos`."""

    src: int
    src_pos: torch.Tensor
    dst_pos: torch.Tensor


def routes(sources: list[list[int]], wanted: list[int]) -> list[Route]:
    """Where each of `wanted` (model channels, in our order) comes from: the first source rank that
    holds it (a replicated KV head is read once). ValueError names a channel no source holds."""
    where: dict[int, tuple[int, int]] = {}
    for rank, channels in enumerate(sources):
        for pos, channel in enumerate(channels):
            where.setdefault(channel, (rank, pos))
    missing = [c for c in wanted if c not in where]
    if missing:
        raise ValueError(f"no source rank holds channels {missing[:8]}")
    by_rank: dict[int, tuple[list[int], list[int]]] = {}
    for pos, channel in enumerate(wanted):
        rank, src_pos = where[channel]
        src, dst = by_rank.setdefault(rank, ([], []))
        src.append(src_pos)
        dst.append(pos)
    return [Route(r, torch.tensor(s), torch.tensor(d)) for r, (s, d) in sorted(by_rank.items())]


@dataclass(frozen=True)
class Plan:
    """How each rank of a decode replica at size `dst.size` is filled from a prefill one at `src.size`."""

    src: Sharding
    dst: Sharding
    kv: list[list[Route]]  # per decode rank
    states: dict[str, list[list[Route]]]  # name -> per decode rank

    @classmethod
    def build(cls, cfg: ModelConfig, prefill_size: int, decode_size: int) -> Plan:
        try:
            src, dst = Sharding.of(cfg, prefill_size), Sharding.of(cfg, decode_size)
            kv = [routes(src.kv, wanted) for wanted in dst.kv]
            states = {
                name: [routes(src.states[name][1], wanted) for wanted in dst.states[name][1]]
                for name in dst.states
            }
        except ValueError as exc:
            raise PeerRefused(
                f"cannot map a prefill replica at tensor_parallel_size {prefill_size} onto a decode "
                f"replica at tensor_parallel_size {decode_size}",
                [str(exc)],
            ) from None
        return cls(src, dst, kv, states)

    @property
    def needed(self) -> list[int]:
        """The prefill ranks some decode rank reads from."""
        ranks = {r.src for per_rank in self.kv for r in per_rank}
        ranks |= {r.src for per_name in self.states.values() for per_rank in per_name for r in per_rank}
        return sorted(ranks)

    def state(
        self, rank: int, name: str, staged: dict[int, dict[str, torch.Tensor]], shape: Any
    ) -> torch.Tensor:
        """Decode rank `rank`'s tensor `name` ([*shape]) from the prefill ranks' staged states."""
        axis = self.dst.states[name][0]
        first = staged[self.states[name][rank][0].src][name]
        out = torch.empty(tuple(shape), dtype=first.dtype)
        for r in self.states[name][rank]:
            out.index_copy_(axis, r.dst_pos, staged[r.src][name].index_select(axis, r.src_pos))
        return out


def scatter_blocks(
    per_rank: list[Route], staged: dict[int, torch.Tensor], kv: torch.Tensor, into: list[int]
) -> int:
    """Copy each route's heads of the staged blocks (staged[p]: [n, L, 2, bs, heads_p, D]) into
    kv[into]; -> the bytes written (this rank's heads only)."""
    nbytes = 0
    for r in per_rank:
        src = staged[r.src].index_select(KV_AXIS + 1, r.src_pos)  # [n, L, 2, bs, k, D]
        for i, block in enumerate(into):
            kv[block].index_copy_(KV_AXIS, r.dst_pos, src[i])
        nbytes += src.numel() * src.element_size()
    return nbytes


__all__ = ["KV_AXIS", "Plan", "Route", "Sharding", "routes", "scatter_blocks"]
