"""The benchmark's math on hand-computed cases: percentiles, TPOT, goodput, attainment, cost."""

from __future__ import annotations

import math

import pytest

from splitserve.ab.client import RequestResult
from splitserve.ab.metrics import (
    SLO,
    bootstrap_ratio,
    cost_per_accepted,
    distserve_goodput,
    meets_slo,
    output_tokens,
    percentile,
    stats_ms,
    summarize,
    tpot_s,
)


def ok(i: int, ttft: float, latency: float, n: int, itl: list[float] | None = None, plen: int = 100):
    return RequestResult(
        i, "t", plen, n, success=True, ttft_s=ttft, latency_s=latency, output_tokens=n, itl_s=itl or []
    )


def failed(i: int, kind: str) -> RequestResult:
    return RequestResult(i, "t", 100, 10, success=False, error_kind=kind)


def test_percentiles_interpolate_linearly():
    x = [1.0, 2.0, 3.0, 4.0]
    # position (n - 1) * p: p50 -> 1.5 -> 2.5; p90 -> 2.7 -> 3.7; p99 -> 2.97 -> 3.97
    assert percentile(x, 50) == pytest.approx(2.5)
    assert percentile(x, 90) == pytest.approx(3.7)
    assert percentile(x, 99) == pytest.approx(3.97)
    assert percentile([5.0], 99) == 5.0
    assert math.isnan(percentile([], 50))


def test_stats_are_milliseconds():
    s = stats_ms([0.1, 0.2, 0.3, 0.4])
    assert s["count"] == 4
    assert s["mean"] == pytest.approx(250.0)
    assert s["p50"] == pytest.approx(250.0)
    assert s["p90"] == pytest.approx(370.0)
    assert s["p95"] == pytest.approx(385.0)
    assert s["p99"] == pytest.approx(397.0)
    assert s["max"] == pytest.approx(400.0)
    assert s["std"] == pytest.approx(math.sqrt(((150**2) * 2 + (50**2) * 2) / 4))
    assert math.isnan(stats_ms([])["p99"])


def test_tpot_excludes_the_first_token():
    assert tpot_s(1.0, 0.2, 5) == pytest.approx(0.2)  # 0.8 s over the 4 tokens after the first
    assert tpot_s(2.0, 0.5, 2) == pytest.approx(1.5)
    assert tpot_s(0.3, 0.3, 1) is None
    assert tpot_s(0.3, 0.3, 0) is None


def test_output_tokens_fall_back_to_chunks_without_usage():
    r = ok(0, 0.1, 0.5, 0, itl=[0.1, 0.1, 0.2])
    assert output_tokens(r) == 4
    assert output_tokens(ok(0, 0.1, 0.5, 7)) == 7


def test_summary_goodput_attainment_and_throughput():
    slo = SLO(ttft_ms=500, tpot_ms=150)
    results = [
        ok(0, 0.1, 1.1, 11, itl=[0.1] * 10, plen=100),  # TPOT 100 ms, TTFT 100 ms: good
        ok(1, 0.6, 1.6, 11, itl=[0.1] * 10, plen=200),  # TTFT 600 ms: misses
        ok(2, 0.2, 2.2, 11, itl=[0.2] * 10, plen=300),  # TPOT 200 ms: misses
        failed(3, "http_503"),
        ok(4, 0.3, 0.3, 1, plen=400),  # one token: TPOT counts as 0 for the SLO (vLLM): good
    ]
    m = summarize(results, 10.0, slo)
    assert (m["requests"], m["completed"], m["failed"]) == (5, 4, 1)
    assert m["failures"] == {"http_503": 1}
    assert m["good"] == 2
    assert m["goodput_rps"] == pytest.approx(0.2)
    assert m["slo_attainment"] == pytest.approx(0.4)
    assert m["request_throughput"] == pytest.approx(0.4)
    assert m["total_output_tokens"] == 34
    assert m["output_throughput"] == pytest.approx(3.4)
    assert m["total_input_tokens"] == 1000
    assert m["total_token_throughput"] == pytest.approx(103.4)
    # TPOT statistics only over requests of more than one token: 100, 100, 200 ms
    assert m["tpot_ms"]["count"] == 3
    assert m["tpot_ms"]["mean"] == pytest.approx(400 / 3)
    assert m["tpot_ms"]["p50"] == pytest.approx(100.0)
    assert m["ttft_ms"]["mean"] == pytest.approx(300.0)  # 100, 600, 200, 300
    assert m["ttft_ms"]["p50"] == pytest.approx(250.0)
    assert m["itl_ms"]["count"] == 30
    assert m["itl_ms"]["mean"] == pytest.approx(400 / 3)
    assert m["e2el_ms"]["max"] == pytest.approx(2200.0)


def test_slo_boundaries_and_e2e():
    r = ok(0, 0.5, 1.5, 11)  # TTFT 500 ms, TPOT 100 ms, e2e 1500 ms
    assert meets_slo(r, SLO(ttft_ms=500, tpot_ms=100))  # equal to the limit meets it (vLLM: s >= r)
    assert not meets_slo(r, SLO(ttft_ms=499.9, tpot_ms=100))
    assert not meets_slo(r, SLO(ttft_ms=500, tpot_ms=99.9))
    assert meets_slo(r, SLO(ttft_ms=None, tpot_ms=None))
    assert not meets_slo(r, SLO(ttft_ms=None, tpot_ms=None, e2e_ms=1000))
    assert not meets_slo(failed(1, "timeout"), SLO(ttft_ms=None, tpot_ms=None))


def test_cost_per_accepted_response():
    # $0.10/h for 360 s = $0.01, over 2 responses that met the SLOs
    assert cost_per_accepted(0.10, 360.0, 2) == pytest.approx(0.005)
    assert cost_per_accepted(4.0 * 2, 1800.0, 100) == pytest.approx(0.04)  # two $4/h GPUs, half an hour
    assert cost_per_accepted(0.10, 360.0, 0) == math.inf


def test_distserve_goodput_is_the_highest_rate_meeting_the_target_from_below():
    pts = [(2.0, 0.8), (0.5, 1.0), (1.0, 0.95), (4.0, 0.95)]
    assert distserve_goodput(pts, 0.9) == 1.0  # 4 req/s meets it again, but 2 already missed
    assert distserve_goodput(pts, 0.75) == 4.0
    assert distserve_goodput([(0.5, 0.5)], 0.9) is None
    assert distserve_goodput([(0.5, math.nan)], 0.9) is None


def test_bootstrap_ratio():
    r, lo, hi = bootstrap_ratio(20, 40, 1.0, 20, 40, 1.0)
    assert r == pytest.approx(1.0) and lo < 1 < hi
    r, lo, hi = bootstrap_ratio(40, 40, 1.0, 10, 40, 1.0)
    assert r == pytest.approx(4.0) and lo > 2
    r, _, _ = bootstrap_ratio(20, 40, 1.0, 20, 40, 2.0)  # b costs half as much per good request
    assert r == pytest.approx(0.5)
    assert all(math.isnan(x) for x in bootstrap_ratio(5, 40, 1.0, 0, 40, 1.0))
    assert bootstrap_ratio(20, 40, 1.0, 15, 40, 1.0, seed=3) == bootstrap_ratio(
        20, 40, 1.0, 15, 40, 1.0, seed=3
    )
