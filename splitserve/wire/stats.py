"""What a worker says about itself: `Health` (GET /health, and the engine core's `Ready`) and
`WorkerStats` (GET /stats, the core's answer to `GetStats`). Read by the runtimes, the router's probes
and metrics, and the worker's own GET /metrics.

`STEP_TOKEN_BUCKETS` are the bucket bounds of the tokens-per-engine-step histogram (vLLM's
`vllm:iteration_tokens_total`): `WorkerStats.iteration_tokens` counts steps per bucket, the router's
vLLM metrics (router/vllm_metrics.py) export them.

One field is an open diagnostic tree, typed `Diagnostics`: the weight loader's report (`Health.load`).
Everything else is typed, the transport's self-description (`KVTransferCounts.transport`,
wire/transport_info.py) included: the router and the runtimes read its counters by name (the requested
backend, fallbacks, fetched bytes, active leases).
"""

from __future__ import annotations

from typing import Any, TypeAlias

import msgspec

from splitserve.wire.result import Result
from splitserve.wire.transport_info import TransportInfo

STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

# An operator's diagnostic tree, free in shape per backend (see the module docstring).
Diagnostics: TypeAlias = dict[str, Any]


class EngineSettings(msgspec.Struct):
    """The knobs the engine runs with (prefix caching as in effect; the step budget as resolved)."""

    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    gpu_memory_utilization: float
    kv_cache_bytes: int | None
    enable_prefix_caching: bool
    enforce_eager: bool
    seed: int | None
    tokenizer: str | None


class Health(msgspec.Struct):
    status: str  # ok | engine_dead | engine_stopped (a 503: missed health checks get it replaced)
    role: str
    model: str
    tokenizer: str | None
    core_pid: int
    kv_backend: str | None
    kv_address: str | None
    layout_fingerprint: str | None
    kv_requested: str | None
    max_model_len: int
    block_bytes: int
    num_blocks: int
    vocab_size: int
    device: str
    dtype: str
    load: Diagnostics  # weights: method, cache status, seconds per stage (model/loader.py)
    startup: dict[str, float]  # this process's age at the end of each start-up phase, by phase
    engine: EngineSettings
    pid: int | None = None  # the front end's (set by the worker, not the core)
    role_epoch: int = 0  # how many times the worker changed role (wire/role.py; set by the worker)


class BlockCounts(msgspec.Struct):
    total: int
    free: int
    held: int  # freed, but a late KV copy may still write them


class SlotCounts(msgspec.Struct):
    total: int
    free: int


class StepCounts(msgspec.Struct):
    forward: int  # steps that ran the model (overlapped or not)
    overlapped: int
    step_s: float  # host wall time inside step()
    loop_s: float  # wall time of the core's loop turns that had work


class IterationTokens(msgspec.Struct):
    """Model steps by the tokens they ran: one count per bound of STEP_TOKEN_BUCKETS and one above the
    largest; `sum`: all tokens run."""

    counts: list[int]
    sum: int


class ThreadCounts(msgspec.Struct):
    """CPU: the worker's own threads, its last step's, steps on lent cores and paced steps."""

    own: int
    now: int
    borrowed_steps: int
    paced_steps: int


class CheckpointCounts(msgspec.Struct):
    """Hybrid models' prefix caching: state checkpoints held, their capacity, saved and restored."""

    entries: int
    capacity: int
    saved: int
    restored: int


class PrefixCacheCounts(msgspec.Struct):
    enabled: bool  # prefix caching as in effect (vLLM's cache_config_info)
    queries: int
    hits: int
    state_checkpoints: CheckpointCounts | None


class SpecDecodeCounts(msgspec.Struct):
    method: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    num_first_step_drafts: int = 0  # verify runs at a request's first decode step (local or imported KV)
    num_head_lost: int = 0  # mtp: requests that lost the head's context (its back-off) and draft no more


class KVTransferCounts(msgspec.Struct):
    backend: str | None
    policy: str
    importing: int
    counts: dict[str, float]  # running totals by name (exports, fetches, fetched_bytes, fetch_seconds, ...)
    failures: dict[str, int]  # failed fetches by error class
    transport: TransportInfo | None  # the transport's self-description (wire/transport_info.py)


class MemoryBytes(msgspec.Struct):
    """CUDA: the worker's memory plan (bytes, engine/memory_plan.py) and what torch holds now and at peak."""

    share: int | None
    weights: int
    non_torch: int
    activations: int
    graphs: int
    transfer: int
    grammar: int
    checkpoints: int
    margin: int
    state_slots: int
    state_bytes: int
    num_blocks: int
    kv_bytes: int
    total: int
    torch_reserved: int
    torch_peak_reserved: int


class WorkerStats(Result):
    role: str
    running: int
    waiting: int
    importing: int
    unfinished: int
    blocks: BlockCounts
    state_slots: SlotCounts
    preemptions: int
    iteration_tokens: IterationTokens
    block_size: int  # tokens per KV block
    prompt_tokens_computed: int
    kv_bytes_per_token: int
    steps: StepCounts
    threads: ThreadCounts
    prefix_cache: PrefixCacheCounts
    kv_transfer: KVTransferCounts | None
    memory: MemoryBytes | None
    spec_decode: SpecDecodeCounts | None


class WorkerRow(msgspec.Struct):
    """One worker as a runtime hands it to the router's metrics: its name and role, whether it is up,
    and its GET /stats, decoded, when it answered (None: down, or no answer this time)."""

    worker: str
    role: str
    up: bool
    stats: WorkerStats | None = None

    def usage(self) -> float | None:
        """The share of the KV blocks in use, when the worker answered and has blocks."""
        if self.stats is None or not self.stats.blocks.total:
            return None
        return 1 - self.stats.blocks.free / self.stats.blocks.total


__all__ = [
    "BlockCounts",
    "CheckpointCounts",
    "Diagnostics",
    "EngineSettings",
    "Health",
    "IterationTokens",
    "KVTransferCounts",
    "MemoryBytes",
    "PrefixCacheCounts",
    "SlotCounts",
    "STEP_TOKEN_BUCKETS",
    "SpecDecodeCounts",
    "StepCounts",
    "ThreadCounts",
    "WorkerRow",
    "WorkerStats",
]
