"""Profiling on this host: engine steps timed on the real engine (`LLMEngine`, the offline API the
workers run) and KV handoffs timed over the real transport, fitted into a `Profile`.

The grid is small on purpose (about two minutes for the default model on one CPU core):
    prefill   one prompt at a time of 64 .. 1024 tokens (one step each), and a long prompt chunked
              by a smaller step budget (its later chunks attend to the earlier ones), the whole set
              timed in `prefill_rounds` rounds (fresh prompts each round, so that no prefix is
              cached) and each shape kept at its median: a host whose speed drifts for a second
              moves one round, not the fit; the spread between rounds is kept in the profile
    decode    batches of 1 to 16 requests at contexts of 64 to 512 tokens, a few steps each
              (the steps that prefilled them are kept too: mixed shapes)
    handoff   1 .. 64 KV blocks exported by one transport and fetched by another, in this process
    co-run    pinned: decode and prompt steps beside a neighbour decoding or prefilling on other
              CPUs (corun.py)
Every step's shape is read off the scheduler's own output for that step, so what is fitted is what
the engine scheduled. The first step at each new shape (oneDNN builds its kernels then) is not kept.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import msgspec
import torch

from splitserve.config.engine import EngineConfig
from splitserve.core.pinning import host_cpus, pin
from splitserve.engine.engine import LLMEngine
from splitserve.plan.corun import drain as _drain
from splitserve.plan.corun import measure_corun
from splitserve.plan.corun import random_prompts as _prompts
from splitserve.plan.cost import chunk_pairs
from splitserve.plan.profile import Profile, StepPoint, TransferPoint, fitted_cost
from splitserve.sampling.params import SamplingParams


@dataclass(frozen=True)
class Grid:
    # lone prompts, dense where served prompts mostly are (a step of one long prompt costs more per
    # token than one of several short prompts of the same total: the decode batches' prefills below)
    prefill_lens: tuple[int, ...] = (64, 128, 256, 384, 512, 1024)
    chunked_len: int = 1024
    chunk_budget: int = 384
    prefill_rounds: int = 3
    # (batch, context) of the decode points
    decode_shapes: tuple[tuple[int, int], ...] = (
        (1, 64),
        (2, 256),
        (4, 256),
        (8, 64),
        (16, 64),
        (1, 512),
        (8, 512),
    )
    decode_steps: int = 5
    transfer_blocks: tuple[int, ...] = (1, 4, 16, 64)
    transfer_reps: int = 5


class _StepRecorder:
    """Wraps the scheduler's `schedule()` to keep each step's chunks, then times `engine.step()`."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.last = None
        self.ids: list[str] = []  # the requests the last `_run_prompts` added
        inner = engine.scheduler.schedule

        def schedule():  # noqa: ANN202
            self.last = inner()
            return self.last

        engine.scheduler.schedule = schedule  # type: ignore[method-assign]

    def step(self) -> StepPoint | None:
        self.last = None
        t0 = time.perf_counter()
        self.engine.step()
        dt = time.perf_counter() - t0
        if self.last is None or not self.last.chunks:
            return None
        p_tokens, pairs, d_seqs, d_ctx = 0, 0.0, 0, 0
        for c in self.last.chunks:
            if c.start >= c.request.num_prompt_tokens:
                d_seqs += 1
                d_ctx += c.start + 1
            else:
                p_tokens += c.num_tokens
                pairs += chunk_pairs(c.start, c.num_tokens)
        return StepPoint(p_tokens, pairs, d_seqs, d_ctx, dt)


def _run_prompts(
    rec: _StepRecorder, prompts: list[list[int]], max_tokens: int, keep: bool
) -> list[StepPoint]:
    """Add `prompts` and step until each has its first token; -> the steps (if `keep`)."""
    engine = rec.engine
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    ids = [engine.add_request(p, params) for p in prompts]
    points = []
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.requests.values()):
        p = rec.step()
        if p is not None and keep:
            points.append(p)
    if max_tokens == 1:
        _drain(engine, ids)
    rec.ids = ids
    return points


def _prefill_round(rec: _StepRecorder, grid: Grid, vocab: int, seed: int) -> list[StepPoint]:
    """Every prefill shape of the grid once, with prompts of their own (`seed`)."""
    points: list[StepPoint] = []
    for i, length in enumerate(grid.prefill_lens):
        points += _run_prompts(rec, _prompts(1, length, vocab, seed + i), 1, keep=True)
    sched = rec.engine.scheduler
    budget, sched.max_num_batched_tokens = sched.max_num_batched_tokens, grid.chunk_budget
    try:
        points += _run_prompts(rec, _prompts(1, grid.chunked_len, vocab, seed + 99), 1, keep=True)
    finally:
        sched.max_num_batched_tokens = budget
    return points


def median_by_shape(points: list[StepPoint]) -> tuple[list[StepPoint], list[float]]:
    """One point per distinct shape (in order of first appearance) at the median of its times; and each
    shape's spread, (slowest - fastest) / median, over its repeats."""
    groups: dict[tuple, list[float]] = {}
    for p in points:
        groups.setdefault((p.prefill_tokens, p.prefill_pairs, p.decode_seqs, p.decode_context), []).append(
            p.seconds
        )
    out, spread = [], []
    for shape, times in groups.items():
        mid = statistics.median(times)
        out.append(StepPoint(*shape, mid))
        spread.append((max(times) - min(times)) / mid)
    return out, spread


def measure_steps(engine: LLMEngine, grid: Grid, log=print) -> tuple[list[StepPoint], list[float]]:  # noqa: ANN001
    """-> (the steps, each prefill shape's spread over the rounds)."""
    rec, vocab = _StepRecorder(engine), engine.model_config.vocab_size
    _run_prompts(rec, _prompts(2, 48, vocab, 1), 8, keep=False)  # warm-up: first use of the kernels
    for _ in range(4):
        rec.step()
    _drain(engine, rec.ids)
    rounds: list[StepPoint] = []
    for r in range(max(1, grid.prefill_rounds)):
        rounds += _prefill_round(rec, grid, vocab, 1000 * (r + 1))
    points, spread = median_by_shape(rounds)
    log(
        f"  prefill: {len(points)} shapes timed {grid.prefill_rounds}x, spread between rounds "
        f"median {statistics.median(spread):.1%}, worst {max(spread):.1%}"
    )
    for i, (batch, ctx) in enumerate(grid.decode_shapes):
        points += _run_prompts(rec, _prompts(batch, ctx, vocab, 30 + i), 100_000, keep=True)
        rec.step()  # the first step at this batch shape warms it
        for _ in range(grid.decode_steps):
            p = rec.step()
            if p is not None:
                points.append(p)
        _drain(engine, rec.ids)
    log(f"  prefill + decode: {len(points)} steps timed")
    return points, spread


def measure_transfers(
    engine: LLMEngine,
    backend: str,
    grid: Grid,
    log=print,  # noqa: ANN001
) -> tuple[list[TransferPoint], int, int]:
    """-> (points, KV bytes per token, state bytes per request) for `backend` between two transports
    in this process, over KV tensors shaped as the engine's."""
    from splitserve.transport import KVLayout, TransportOptions, make_transport
    from splitserve.transport.stream.shm import allocate_shared_kv

    kv = engine.kv_cache
    n = max(grid.transfer_blocks) + 1
    shape = (n, *kv.shape[1:])
    src = allocate_shared_kv(shape, kv.dtype) if backend == "shm" else torch.zeros(shape, dtype=kv.dtype)
    src.copy_(torch.randn(shape).to(kv.dtype))
    dst = torch.zeros(shape, dtype=kv.dtype)
    layout = KVLayout.from_tensor(src, "profile")
    opts = TransportOptions(lease_s=600, fetch_timeout_s=60)
    exporter = make_transport(backend, src, layout, secret="profile", options=opts)
    fetcher = make_transport(backend, dst, layout, secret="profile", options=opts)
    exporter.listen()
    points: list[TransferPoint] = []
    try:
        for blocks in grid.transfer_blocks:
            times = []
            for rep in range(grid.transfer_reps + 1):
                handle = exporter.export(
                    f"profile-{blocks}-{rep}", list(range(blocks)), blocks * layout.block_size
                )
                t0 = time.perf_counter()
                fetcher.fetch(handle, list(range(1, blocks + 1)))
                times.append(time.perf_counter() - t0)
                exporter.release(handle)
            points.append(TransferPoint(blocks * layout.block_nbytes, statistics.median(times[1:])))
    finally:
        fetcher.close()
        exporter.close()
    log(f"  handoff over {backend}: {len(points)} sizes timed")
    state_bytes = engine.states.nbytes_per_slot() if engine.states.enabled else 0
    return points, layout.block_nbytes // layout.block_size, state_bytes


def profile_engine(
    config: EngineConfig,
    backend: str = "shm",
    threads: int = 1,
    grid: Grid | None = None,
    log=print,  # noqa: ANN001
    pinned: bool = False,
) -> Profile:
    """Build an engine with `config`, time the grid, fit. `threads`: torch threads (a CPU worker's).
    `pinned`: time it bound to `threads` CPUs of its own, as a `runtime.pin_cores` worker runs."""
    grid = grid or Grid()
    started = time.perf_counter()
    before, affinity = torch.get_num_threads(), host_cpus()
    if pinned:
        pin(affinity[:threads])
    torch.set_num_threads(threads)
    try:
        log("profiling: loading the model ...")
        engine = LLMEngine(config, tokenizer=False)
        steps, spread = measure_steps(engine, grid, log)
        transfers, per_token, state = measure_transfers(engine, backend, grid, log)
        others = affinity[threads : 2 * threads]  # a neighbour's CPUs, as a second pinned worker's
        corun = measure_corun(engine, config, others, log) if pinned and len(others) == threads else {}
    finally:
        torch.set_num_threads(before)
        if pinned:
            pin(affinity)
    cost, step_fit, transfer_fit = fitted_cost(steps, transfers, per_token, state)
    cost = msgspec.structs.replace(cost, **corun)
    device = engine.device
    return Profile(
        model=config.model or "default",
        device=str(device),
        dtype=str(engine.dtype).removeprefix("torch."),
        threads=threads,
        pinned=pinned,
        backend=backend,
        block_size=engine.block_size,
        max_num_batched_tokens=config.batched_tokens(device),
        max_num_seqs=config.max_num_seqs,
        cost=cost,
        step_fit=step_fit,
        transfer_fit=transfer_fit,
        steps=steps,
        transfers=transfers,
        measured_s=time.perf_counter() - started,
        prefill_spread=(statistics.median(spread), max(spread)),
    )


__all__ = ["Grid", "measure_steps", "median_by_shape", "measure_transfers", "profile_engine"]
