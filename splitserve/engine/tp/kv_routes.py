"""Which rank holds which KV heads and state channels, at two tensor-parallel sizes, and the copies that
carry one layout into the other.

A rank's KV cache holds some of the model's KV heads (a contiguous run, or one shared head when the
model has fewer KV heads than ranks), and a hybrid model's state tensors some of its Gated DeltaNet
channels (model/parallel.py: `kv_head_index`, `state_index`). Moving a request from a prefill replica at
size P to a decode replica at size D is, per decode rank, a list of `Route`s: from prefill rank p, the
positions `src` along the split axis go to positions `dst` of this rank's tensor.

    plan = Plan.build(cfg, prefill_size, decode_size)   # PeerRefused if the sizes cannot be mapped
    plan.needed                                          # the prefill ranks any decode rank reads
    parts(plan, d)                                       # decode rank d's reads, one per prefill rank:
                                                         # the runs it asks for, the runs they fill
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from splitserve.model.config import ModelConfig
from splitserve.model.parallel import check_divisible, kv_head_index, state_index
from splitserve.transport.errors import PeerRefused
from splitserve.transport.frames import Runs, Select
from splitserve.transport.layout import KVLayout


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
            if name not in self.states:  # not split by heads (the MTP head's hidden): whole on every rank
                shapes.append((name, shape, dtype))
                continue
            axis, channels, _ = self.states[name]
            dims = list(shape)
            dims[axis] = len(channels[rank])
            shapes.append((name, tuple(dims), dtype))
        return replace(full, num_kv_heads=len(self.kv[rank]), state_shapes=tuple(shapes))

    def full_layout(self, rank0: KVLayout, num_kv_heads: int) -> KVLayout:
        """The model's unsharded layout, from rank 0's (what handles of every size are stamped with)."""
        shapes = []
        for name, shape, dtype in rank0.state_shapes:
            if name not in self.states:
                shapes.append((name, shape, dtype))
                continue
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


def paired_runs(route: Route) -> tuple[Runs, Runs]:
    """The route's positions as runs (first, count) contiguous on both sides: (source runs, ours)."""
    src: list[tuple[int, int]] = []
    dst: list[tuple[int, int]] = []
    last = None
    for s, d in zip(route.src_pos.tolist(), route.dst_pos.tolist(), strict=True):
        if last is not None and (s, d) == (last[0] + 1, last[1] + 1):
            src[-1], dst[-1] = (src[-1][0], src[-1][1] + 1), (dst[-1][0], dst[-1][1] + 1)
        else:
            src.append((s, 1))
            dst.append((d, 1))
        last = (s, d)
    return tuple(src), tuple(dst)


@dataclass(frozen=True)
class Part:
    """What one decode rank reads from one prefill rank: runs of the source's KV heads and state
    channels (`select`, the fetch asks for these) and where each run lands in ours (`heads`, `states`,
    the same shapes of runs in the same order)."""

    src: int
    select: Select
    heads: Runs
    states: tuple[tuple[str, int, Runs], ...]


def parts(plan: Plan, rank: int) -> list[Part]:
    """Decode rank `rank`'s parts, one per prefill rank it reads from (rank order)."""
    by_src: dict[int, tuple[list, list, list, list]] = {}
    for r in plan.kv[rank]:
        src, dst = paired_runs(r)
        entry = by_src.setdefault(r.src, ([], [], [], []))
        entry[0].extend(src)
        entry[1].extend(dst)
    for name, per_rank in plan.states.items():
        axis = plan.dst.states[name][0]
        for r in per_rank[rank]:
            src, dst = paired_runs(r)
            entry = by_src.setdefault(r.src, ([], [], [], []))
            entry[2].append((name, axis, src))
            entry[3].append((name, axis, dst))
    return [
        Part(p, Select(tuple(sh), tuple(ss)), tuple(dh), tuple(ds))
        for p, (sh, dh, ss, ds) in sorted(by_src.items())
    ]


__all__ = ["Part", "Plan", "Route", "Sharding", "paired_runs", "parts", "routes"]
