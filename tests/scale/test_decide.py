"""The scaling decision as a pure function of recorded samples: which role grows on which broken SLO,
when a replica goes, the bounds, the cooldown and the hysteresis band that keep it from flapping."""

from __future__ import annotations

from dataclasses import replace

from splitserve.scale.decide import Decision, Memory, Policy, Sample, decide

POLICY = Policy(
    ttft_s=0.5,
    itl_s=0.1,
    bounds={"prefill": (1, 3), "decode": (1, 2)},
    cooldown_s=10.0,
    down_after_s=20.0,
    low_load=0.5,
    max_waiting_per_replica=4.0,
    max_kv_usage=0.9,
)


def sample(now: float, ttft: float | None, itl: float | None, p: int = 1, d: int = 1, **kw) -> Sample:
    return Sample(now=now, ttft_s=ttft, itl_s=itl, requests=kw.pop("requests", 10),
                  replicas={"prefill": p, "decode": d}, **kw)  # fmt: skip


def run(samples: list[Sample], policy: Policy = POLICY, model=None) -> list[Decision]:  # noqa: ANN001
    """Replays samples as the controller does, the shape following each change at once."""
    mem, shape, out = Memory(), None, []
    for s in samples:
        if shape is not None:
            s = replace(s, replicas=dict(shape))
        d = decide(s, policy, mem, model)
        shape = dict(s.replicas)
        if d.role is not None:
            shape[d.role] += d.delta
        out.append(d)
    return out


def changes(decisions: list[Decision]) -> list[tuple[str | None, int, str]]:
    return [(d.role, d.delta, d.reason) for d in decisions if d.delta]


def test_broken_ttft_adds_a_prefill_replica_and_broken_itl_a_decode_one():
    d = decide(sample(100, ttft=0.8, itl=0.05), POLICY, Memory())
    assert (d.role, d.delta, d.reason) == ("prefill", 1, "ttft_slo")
    d = decide(sample(100, ttft=0.2, itl=0.15), POLICY, Memory())
    assert (d.role, d.delta, d.reason) == ("decode", 1, "itl_slo")


def test_both_broken_the_further_over_grows_first():
    d = decide(sample(100, ttft=0.6, itl=0.3), POLICY, Memory())  # TTFT 1.2x, ITL 3x its SLO
    assert (d.role, d.reason) == ("decode", "itl_slo")


def test_queue_and_kv_pressure_grow_before_the_slos_break():
    d = decide(sample(100, 0.1, 0.02, waiting={"prefill": 9}), POLICY, Memory())
    assert (d.role, d.delta, d.reason) == ("prefill", 1, "prefill_queue")
    d = decide(sample(100, 0.1, 0.02, kv_usage={"decode": 0.95}), POLICY, Memory())
    assert (d.role, d.delta, d.reason) == ("decode", 1, "decode_kv")


def test_cooldown_after_a_change_and_bounds_hold():
    mem = Memory()
    assert decide(sample(100, 0.8, 0.05), POLICY, mem).delta == 1
    held = decide(sample(105, 0.8, 0.05, p=2), POLICY, mem)
    assert (held.delta, held.reason) == (0, "cooldown")
    assert decide(sample(111, 0.8, 0.05, p=2), POLICY, mem).delta == 1
    top = decide(sample(200, 0.8, 0.05, p=3), POLICY, mem)  # prefill at its max
    assert (top.delta, top.reason) == (0, "at_max")
    mem = Memory()
    low = [decide(sample(t, 0.01, 0.01, requests=0), POLICY, mem) for t in range(0, 100, 5)]
    assert all(d.delta == 0 for d in low) and low[-1].reason == "at_min"


def test_a_starting_or_draining_replica_holds_every_change():
    d = decide(sample(100, 0.8, 0.3, pending=1), POLICY, Memory())
    assert (d.delta, d.reason) == (0, "warming")


def test_low_load_removes_one_replica_per_comfortable_period_down_to_the_minimum():
    quiet = [sample(t, 0.05, 0.01, p=3, d=2) for t in range(0, 120, 5)]
    decisions = run(quiet)
    got = [(t * 5, d.role) for t, d in enumerate(decisions) if d.delta]
    # comfortable from t=0: the first removal at t=20, then one per 20 s of comfort counted from the
    # first interval after each change (25 -> 45, 50 -> 70);
    # the role furthest under its SLO (decode: ITL 10%, prefill: TTFT 10%; a tie goes to the bigger pool)
    assert [t for t, _ in got] == [20, 45, 70]
    assert sorted(r for _, r in got) == ["decode", "prefill", "prefill"]
    assert all(d.delta <= 0 for d in decisions)


def test_load_steps_up_then_down_without_flapping():
    """A recorded run: quiet, TTFT breaks (prefill grows), ITL breaks (decode grows), figures settle
    inside the hysteresis band (nothing moves, however they wobble), then load drops (both shrink)."""
    quiet = [sample(t, 0.1, 0.02, requests=2) for t in range(0, 30, 5)]
    ttft = [sample(t, 0.9, 0.04) for t in range(30, 40, 5)]
    itl = [sample(t, 0.3, 0.14) for t in range(40, 60, 5)]
    band = [sample(t, 0.3 + 0.15 * (t % 10 == 0), 0.06 + 0.03 * (t % 10 == 5)) for t in range(60, 120, 5)]
    down = [sample(t, 0.05, 0.01, requests=0) for t in range(120, 200, 5)]
    decisions = run(quiet + ttft + itl + band + down)
    made = changes(decisions)
    assert made[:2] == [("prefill", 1, "ttft_slo"), ("decode", 1, "itl_slo")]
    assert sorted(made[2:]) == [("decode", -1, "low_load"), ("prefill", -1, "low_load")]
    band_decisions = decisions[len(quiet + ttft + itl) : len(quiet + ttft + itl + band)]
    assert all(d.delta == 0 and d.reason == "steady" for d in band_decisions)


def test_the_planner_vetoes_a_removal_and_picks_between_roles():
    quiet = [sample(t, 0.1, 0.02, p=2, d=2) for t in range(0, 60, 5)]
    never = run(quiet, model=lambda shape, s: 0.5)  # every smaller shape breaks the SLOs
    assert not changes(never) and never[-1].reason == "planner"
    both = sample(100, 0.6, 0.3)  # ITL further over, but the simulator says prefill helps more
    d = decide(both, POLICY, Memory(), model=lambda shape, s: 1.0 if shape["prefill"] == 2 else 0.2)
    assert (d.role, d.delta) == ("prefill", 1)


def test_too_few_observations_under_many_requests_in_flight_is_not_comfort():
    """A slow deployment yields few first tokens an interval: unjudged, but busy, so nothing is removed;
    the same scarcity with the engines nearly empty (a trickle) is comfort."""
    slow = [sample(t, None, None, p=2, d=2, requests=1, running={"prefill": 3, "decode": 2})
            for t in range(0, 60, 5)]  # fmt: skip
    assert not changes(run(slow))
    trickle = [sample(t, None, None, p=2, d=2, requests=1, running={"prefill": 1}) for t in range(0, 60, 5)]
    assert sorted(changes(run(trickle))) == [("decode", -1, "low_load"), ("prefill", -1, "low_load")]
