"""The served probe (plan/served.py): the factors from lone requests' timings against the profile
(computed by hand), the deployment it serves, and a real probe through `splitserve serve`."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from splitserve.ab.drive import RequestResult
from splitserve.config.manifest import load_manifest
from splitserve.plan import served
from splitserve.plan.cost import StepCost

COST = StepCost(base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002)  # prefill of 100: 110 ms
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "disaggregated.yaml"


def _result(
    prompt_len: int, ttft_s: float, itl_s: list[float], ok: bool = True, server_ms: dict | None = None
) -> RequestResult:
    return RequestResult(
        0, "synthetic", prompt_len, len(itl_s) + 1, success=ok, ttft_s=ttft_s, itl_s=itl_s,
        server_ms=server_ms or {},
    )  # fmt: skip


def test_the_factors_are_the_medians_of_first_token_and_of_token_gap_ratios():
    results = [
        _result(100, 0.110 * 1.2, [0.012 * 1.1] * 4),  # prefill 110 ms, a decode step 12 ms
        _result(190, 0.200 * 1.3, [0.012, 0.012 * 1.05, 0.012 * 1.05]),
        _result(100, 9.0, [], ok=False),  # a failure counts for nothing
    ]
    # first token 1.2 and 1.3 the prefill step; token gaps 1.1 and 1.05 the decode step
    assert served.served_factors(results, COST) == pytest.approx((1.25, 1.075))
    with pytest.raises(RuntimeError, match="no answer"):
        served.served_factors(results[2:], COST)


def test_the_request_cost_is_what_lies_outside_the_routers_queue_and_prefill():
    results = [
        _result(100, 0.118, [0.0144], server_ms={"queue": 0.5, "prefill": 110.5, "ttft": 115.0}),  # 7 ms
        _result(100, 0.125, [0.0144], server_ms={"queue": 1.0, "prefill": 115.0, "ttft": 120.0}),  # 9 ms
        _result(100, 0.131, [0.0144], server_ms={"queue": 0.0, "prefill": 120.0, "ttft": 125.0}),  # 11 ms
        _result(100, 0.900, [], ok=False, server_ms={"queue": 0.0, "prefill": 1.0}),  # a failure: none
        _result(100, 0.200, [0.012]),  # no router timings (another server): none
    ]
    assert served.request_cost(results) == pytest.approx(0.009)
    assert served.request_cost(results[3:]) == 0.0
    # the factor then compares what is left of the first token's time with the prefill step
    factors = served.served_factors(results[:3], COST, request_s=0.009)
    # prefill ratios (118-9, 125-9, 131-9) / 110 = 0.991, 1.055, 1.109; decode ratios 14.4 / 12 = 1.2
    assert factors == pytest.approx((1.0545, 1.2), abs=1e-3)


def test_the_probe_serves_the_model_colocated_on_pinned_shares():
    m = served.served_manifest(load_manifest(EXAMPLE), workers=2)
    assert m.mode == "colocated" and m.pools()["colocated"].replicas == 2
    assert m.runtime.pin_cores and not m.runtime.standby and m.router.policy == "least_loaded"
    assert m.transport.backend == "shm"  # the rest is the manifest's


def test_a_real_probe_through_the_server_gives_a_finite_factor(monkeypatch):
    monkeypatch.setattr(served, "PROMPT_LENS", (64, 96))
    monkeypatch.setattr(served, "GAP_S", 1.0)
    lines: list[str] = []
    monkeypatch.setattr(served, "ROUNDS", 1)
    prefill, decode, request_s = served.measure_served(load_manifest(EXAMPLE), COST, 2, log=lines.append)
    assert all(math.isfinite(f) and f > 0 for f in (prefill, decode))
    assert 0 < request_s < 1  # the router's timings came back with the answers
    assert lines and "2 lone requests" in lines[0]
