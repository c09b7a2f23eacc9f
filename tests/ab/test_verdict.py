"""The verdict rules on made-up results: trial, reject (and why), wait."""

from __future__ import annotations

import math

from splitserve.ab.verdict import VerdictConfig, decide, rules_text

CFG = VerdictConfig(margin=0.10, attainment_target=0.9)


def target(name: str, goods: list[int], n: int = 40, duration: float = 40.0, cpus: int = 2, kv=math.nan):
    usd = 0.05 * cpus
    points = [
        {
            "rate": rate,
            "metrics": {
                "good": g,
                "requests": n,
                "duration_s": duration,
                "goodput_rps": g / duration,
                "slo_attainment": g / n,
            },
            "server": {"kv_share_of_ttft": kv},
        }
        for rate, g in zip((0.5, 1.0, 2.0), goods, strict=True)
    ]
    return {
        "name": name,
        "hardware": {"devices": {"cpu": cpus}, "usd_per_hour": usd},
        "points": points,
        "error": None,
    }


def test_trial_when_goodput_gains_beyond_margin_at_equal_hardware():
    v = decide(target("disagg", [40, 38, 30]), target("colo", [40, 30, 12]), CFG)
    assert (v.verdict, v.rule, v.equal_hardware) == ("trial", "R1", True)
    assert [r["class"] for r in v.rows] == ["same", "better", "better"]
    assert "1 req/s, 2 req/s" in v.reasons[0]
    assert v.distserve == {"disagg": 1.0, "colo": 0.5}


def test_reject_for_transfer_overhead():
    v = decide(target("disagg", [30, 15, 5], kv=0.35), target("colo", [40, 38, 30]), CFG)
    assert (v.verdict, v.rule) == ("reject", "R2")
    assert any("transfer overhead" in r and "35%" in r for r in v.reasons)


def test_reject_for_idle_duplication_compared_per_dollar():
    # the same goodput on twice the devices: half the goodput per dollar
    v = decide(target("disagg", [40, 38, 30], cpus=2), target("colo", [40, 38, 30], cpus=1), CFG)
    assert (v.verdict, v.rule, v.equal_hardware) == ("reject", "R2", False)
    assert all(r["ratio_per_usd"] == 0.5 for r in v.rows)
    assert any("idle duplication" in r for r in v.reasons)
    assert any("compared per dollar" in r for r in v.reasons)


def test_wait_inside_margin_or_noise():
    v = decide(target("disagg", [40, 36, 22]), target("colo", [40, 35, 20]), CFG)
    assert (v.verdict, v.rule) == ("wait", "R3")
    assert all(r["class"] == "same" for r in v.rows)
    # 10% more than the margin but too few requests to tell from noise
    small = decide(target("d", [3, 3, 3], n=4, duration=4), target("c", [2, 2, 2], n=4, duration=4), CFG)
    assert small.verdict == "wait"


def test_wait_when_mixed():
    v = decide(target("disagg", [40, 20, 30]), target("colo", [40, 38, 10]), CFG)
    assert (v.verdict, v.rule) == ("wait", "R3")
    assert "mixed" in v.reasons[0]


def test_no_comparison_when_a_run_failed_or_nothing_met_slos():
    bad = target("disagg", [40, 40, 40]) | {"error": "RuntimeError: did not start"}
    v = decide(bad, target("colo", [40, 40, 40]), CFG)
    assert (v.verdict, v.rule) == ("wait", "R0") and "did not start" in v.reasons[0]
    v = decide(target("d", [0, 0, 0]), target("c", [0, 0, 0]), CFG)
    assert (v.verdict, v.rule) == ("wait", "R0")


def test_a_side_with_nothing_good_loses():
    v = decide(target("disagg", [40, 20, 10]), target("colo", [40, 0, 0]), CFG)
    assert v.verdict == "trial"
    assert v.rows[1]["ratio_per_usd"] == math.inf


def test_rules_are_written_out():
    text = " ".join(rules_text(CFG))
    for word in ("R0", "R1 trial", "R2 reject", "R3 wait", "10%", "transfer overhead", "idle duplication"):
        assert word in text


def test_a_difference_under_unequal_machine_load_does_not_count():
    cand, base = target("disagg", [40, 30, 12]), target("colo", [40, 38, 30])
    for p, other in zip(cand["points"], (0.1, 1.2, 0.2), strict=True):
        p["util"] = {"cpu_other_cores": other}
    for p in base["points"]:
        p["util"] = {"cpu_other_cores": 0.1}
    v = decide(cand, base, CFG)
    assert [r["class"] for r in v.rows] == ["same", "noisy", "worse"]
    assert v.verdict == "reject"  # 2 req/s still counts: the load was alike there
    cand["points"][2]["util"]["cpu_other_cores"] = 0.9
    v = decide(cand, base, CFG)
    assert (v.verdict, v.rule) == ("wait", "R3")
    assert "machine noise at 1 req/s (other processes: 1.20 vs 0.10 cores), 2 req/s" in v.reasons[0]
