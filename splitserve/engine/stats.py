"""What an engine reports about itself (`LLMEngine.stats()`), read by the worker's operations
(core/ops.py) instead of the engine's pool, scheduler and state slots."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

import torch

from splitserve.engine.kv_transfer import KVTransfers
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.spec.verify import SpecStats
from splitserve.engine.state_pool import StatePool
from splitserve.wire.stats import STEP_TOKEN_BUCKETS


@dataclass
class StepTokens:
    """How many model steps ran how many tokens: a count per bucket of STEP_TOKEN_BUCKETS (the last
    count is above the largest bound), and the tokens in all."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(STEP_TOKEN_BUCKETS) + 1))
    total: int = 0

    def add(self, tokens: int) -> None:
        self.counts[bisect.bisect_left(STEP_TOKEN_BUCKETS, tokens)] += 1
        self.total += tokens


@dataclass(frozen=True)
class BlockStats:
    total: int
    free: int
    held: int  # freed, but a late KV copy may still write them
    leased: int  # held under a lease (a KV export, a probe)


@dataclass(frozen=True)
class CheckpointStats:
    """Hybrid models' prefix caching (engine/state_cache.py): entries held, saved and restored."""

    entries: int
    capacity: int
    saved: int
    restored: int


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    waiting_for_kv: int  # KV imports not yet joined (waiting for room, or loading)
    unfinished: int
    blocks: BlockStats
    block_bytes: int  # one block of the KV cache, all layers
    state_slots_total: int
    state_slots_free: int
    preemptions: int
    forward_steps: int  # steps that ran the model (overlapped or not)
    overlapped_steps: int
    step_seconds: float  # host wall time inside step()
    prefix_caching: bool  # as in effect (hybrid models: off without state checkpoints)
    prefix_queries: int
    prefix_hits: int
    prompt_tokens_computed: int  # prompt tokens run through the model (not cached, not imported)
    state_checkpoints: CheckpointStats | None
    step_tokens: StepTokens
    spec_decode: SpecStats | None = None  # speculative decoding's counters, when it is on

    @classmethod
    def collect(
        cls,
        scheduler: Scheduler,
        states: StatePool,
        transfers: KVTransfers,
        kv_cache: torch.Tensor,
        *,
        unfinished: int,
        steps: tuple[int, int, float, StepTokens],  # forward, overlapped, seconds, tokens per step
        spec: SpecStats | None = None,
    ) -> EngineStats:
        pool, ckpt = scheduler.block_manager.pool, scheduler.block_manager.checkpoints
        checkpoints = None
        if ckpt is not None:
            checkpoints = CheckpointStats(len(ckpt), ckpt.num_entries, ckpt.saved, ckpt.restored)
        return cls(
            running=len(scheduler.running),
            waiting=len(scheduler.waiting),
            waiting_for_kv=len(scheduler.waiting_for_kv),
            unfinished=unfinished,
            blocks=BlockStats(pool.num_blocks, pool.num_free, pool.num_held, transfers.num_held_blocks),
            block_bytes=kv_cache[0].numel() * kv_cache.element_size(),
            state_slots_total=states.num_slots,
            state_slots_free=states.num_free,
            preemptions=scheduler.num_preemptions,
            forward_steps=steps[0],
            overlapped_steps=steps[1],
            step_seconds=steps[2],
            prefix_caching=pool.enable_prefix_caching,
            prefix_queries=scheduler.prefix_queries,
            prefix_hits=scheduler.prefix_hits,
            prompt_tokens_computed=scheduler.prompt_tokens_computed,
            state_checkpoints=checkpoints,
            step_tokens=StepTokens(list(steps[3].counts), steps[3].total),
            spec_decode=spec,
        )


__all__ = ["BlockStats", "CheckpointStats", "EngineStats", "StepTokens"]
