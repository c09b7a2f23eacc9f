"""What the controller reads: an interval's percentile from the router's own histograms (bucket deltas,
interpolated as PromQL's histogram_quantile), per-role figures from worker /stats rows, and the
planner's answer for a shape on a hand-made profile."""

from __future__ import annotations

import asyncio

import pytest
from worker_rows import worker_row

from splitserve.router.metrics import RouterMetrics
from splitserve.scale.decide import Sample
from splitserve.scale.signals import RouterSignals, quantile, role_figures
from splitserve.wire.stats import WorkerRow


def test_quantile_of_an_interval_is_interpolated_within_its_bucket():
    before = [(0.1, 10.0), (0.5, 10.0), (1.0, 10.0), (float("inf"), 10.0)]
    now = [(0.1, 10.0), (0.5, 14.0), (1.0, 20.0), (float("inf"), 20.0)]  # 4 in (0.1, 0.5], 6 in (0.5, 1]
    assert quantile(0.5, now, before) == (pytest.approx(0.5 + 0.5 * (5 - 4) / 6), 10)
    assert quantile(0.2, now, before) == (pytest.approx(0.1 + 0.4 * 2 / 4), 10)
    assert quantile(0.9, now, now) == (None, 0)
    past = [(0.1, 0.0), (float("inf"), 3.0)]
    assert quantile(0.9, past, []) == (0.1, 3)  # beyond the largest bound: that bound


def test_role_figures_from_worker_stats():
    rows = [
        worker_row("prefill-0", "prefill", running=1, waiting=5, blocks={"free": 9}),
        worker_row("prefill-1", "prefill", running=2, waiting=1, blocks={"free": 4, "held": 1}),
        worker_row("decode-0", "decode", running=7, blocks={"free": 1}),
        worker_row("decode-1", "decode", up=False),
        WorkerRow("decode-2", "decode", True),  # up, but no answer this time
    ]
    waiting, running, kv = role_figures(rows)
    assert waiting == {"prefill": 6, "decode": 0}
    assert running == {"prefill": 3, "decode": 7}
    assert kv == {"prefill": pytest.approx(0.5), "decode": pytest.approx(0.9)}


def test_router_signals_read_the_router_histograms_per_interval():
    m = RouterMetrics("tiny")

    async def stats() -> list[WorkerRow]:
        return [worker_row("prefill-0", "prefill", waiting=2)]

    signals = RouterSignals(
        m, "tiny", 0.9, 3, 5.0, stats, lambda: ({"prefill": 1, "decode": 1}, 0), start=0.0
    )
    for _ in range(10):
        m.ttft.labels("tiny").observe(2.0)
    m.prompt_tokens.labels("tiny").inc(1000)
    m.generation_tokens.labels("tiny").inc(200)
    s = asyncio.run(signals.sample(5.0))
    assert s.requests == 10 and 1.0 < s.ttft_s <= 2.5 and s.itl_s is None  # no ITL observed
    assert (s.prompt_tokens, s.output_tokens, s.interval_s) == (1000, 200, 5.0)
    assert s.waiting == {"prefill": 2}
    m.ttft.labels("tiny").observe(0.01)
    later = asyncio.run(signals.sample(10.0))  # one request in the window since: too few to judge
    assert later.requests == 1 and later.ttft_s is None and later.prompt_tokens == 0


def test_the_planner_model_replays_the_interval_through_the_simulator():
    from splitserve.ab.metrics import SLO
    from splitserve.plan.cost import StepCost
    from splitserve.plan.profile import FitReport, Profile
    from splitserve.plan.replica import EngineLimits
    from splitserve.scale.model import load_trace, simulated

    # a prefill token costs 1 ms, a decode step 10 ms: 20 requests of 100 prompt tokens in 1 s need
    # 2 s of prefill on one worker (TTFT grows without bound), 1 s on two
    cost = StepCost(base_s=0.0, prefill_token_s=0.001, decode_seq_s=0.01, latency_s=0.0, bytes_per_s=1e12,
                    kv_bytes_per_token=1, state_bytes=0)  # fmt: skip
    fit = FitReport(points=0, rms_rel=0.0, max_rel=0.0, worst="")
    profile = Profile(model="m", device="cpu", dtype="f32", threads=1, backend="tcp", block_size=16,
                      max_num_batched_tokens=256, max_num_seqs=64, cost=cost, step_fit=fit,
                      transfer_fit=fit)  # fmt: skip
    s = Sample(now=0.0, ttft_s=None, itl_s=None, requests=20, replicas={"prefill": 1, "decode": 1},
               interval_s=1.0, prompt_tokens=2000, output_tokens=100)  # fmt: skip
    assert len(load_trace(s)) == 60
    model = simulated(profile, SLO(ttft_ms=500, tpot_ms=100), EngineLimits(256, 64, 16, False))
    assert model({"prefill": 1, "decode": 1}, s) < 0.5
    assert model({"prefill": 3, "decode": 1}, s) >= 0.9
