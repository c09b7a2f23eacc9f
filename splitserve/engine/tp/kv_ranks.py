"""The KV transport of an engine at tensor_parallel_size > 1 (rank 0's process): one transport per
rank over that rank's pool (rank 0's own, the others mapped from shared memory: pools.py) serves
exports, joined in one `TPTransport` (kv_transport.py); imports are read by each rank in its own
process (rank_reads.py)."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from splitserve.engine.tp.kv_routes import Sharding
from splitserve.engine.tp.kv_transport import Opener, ShardedFetch, TPTransport
from splitserve.engine.tp.pools import mapped
from splitserve.engine.tp.read_orders import Reach, RemoteReads
from splitserve.model.config import ModelConfig
from splitserve.transport.layout import KVLayout
from splitserve.transport.lease import FreeCallback
from splitserve.transport.transport import KVTransport

if TYPE_CHECKING:
    from splitserve.engine.engine import LLMEngine

# (a rank's kv cache, its layout, on_free) -> that rank's transport
Maker = Callable[[torch.Tensor, KVLayout, FreeCallback | None], KVTransport]


def open_ranks(
    engine: LLMEngine,
    full: KVLayout,
    cfg: ModelConfig,
    make: Maker,
    opener: Opener,
    on_free: FreeCallback,
    reach: Callable[[], Reach],
) -> TPTransport:
    """A transport serving every rank's pool of `engine` (rank 0 of its group) and filling them, each
    rank's in its own process (`reach`: how the other ranks open their channels)."""
    if engine.device.type != "cpu":
        raise ValueError(
            "a disaggregated replica at tensor_parallel_size > 1 moves its KV on the CPU only for now"
        )
    group = engine.runner.group  # type: ignore[attr-defined]  # a TPRunner
    sharding = Sharding.of(cfg, group.size)
    pools = [(engine.kv_cache, engine.states.states), *mapped(group)]
    tp = TPTransport(full, [states for _, states in pools], on_free)
    ranks = [make(kv, sharding.rank_layout(full, r), tp.rank_freed) for r, (kv, _) in enumerate(pools)]
    remote = RemoteReads(group.store, group.size, reach)
    tp.attach(ranks, ShardedFetch(cfg, full, engine.kv_cache, ranks, opener, remote))
    return tp


__all__ = ["Maker", "open_ranks"]
