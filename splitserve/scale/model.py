"""The planner's model as the controller asks it (decide.ShapeModel): would this P:D shape serve the load
just seen within the SLOs? The interval's load (requests, mean prompt and output lengths) is replayed as
an even trace of three intervals through the planner's simulator (plan/simulator.py) with the measured
profile's step costs, and the share of requests within both SLOs is the answer.
"""

from __future__ import annotations

from splitserve.ab.metrics import SLO
from splitserve.ab.workload import BenchRequest
from splitserve.plan.goodput import meets
from splitserve.plan.profile import Profile
from splitserve.plan.replica import EngineLimits
from splitserve.plan.simulator import Deployment, simulate
from splitserve.scale.decide import Sample, Shape, ShapeModel

REPLAY = 3  # intervals of load replayed: the first fills the queues, the rest are judged with it


def load_trace(s: Sample) -> list[BenchRequest]:
    """The interval's load as an even trace: distinct prompts (no prefix hits) of the mean lengths."""
    if s.requests <= 0 or s.interval_s <= 0:
        return []
    prompt = max(1, round(s.prompt_tokens / s.requests))
    output = max(1, round(s.output_tokens / s.requests))
    gap = s.interval_s / s.requests
    n = s.requests * REPLAY
    return [
        BenchRequest(i, tuple(range(i * prompt, (i + 1) * prompt)), prompt, output, arrival_s=i * gap)
        for i in range(n)
    ]


def simulated(profile: Profile, slo: SLO, limits: EngineLimits) -> ShapeModel:
    """A ShapeModel on `profile`'s step costs, judging each request by `slo`."""

    def attainment(shape: Shape, s: Sample) -> float:
        trace = load_trace(s)
        if not trace:
            return 1.0
        if "colocated" in shape:
            dep = Deployment.colocated(shape["colocated"], limits)
        else:
            dep = Deployment.split(shape.get("prefill", 1), shape.get("decode", 1), limits)
        records = simulate(trace, dep, profile.cost).records
        return sum(meets(r, slo) for r in records) / max(len(records), 1)

    return attainment


def from_manifest(
    path: str, ttft_ms: float, itl_ms: float, block_size: int, prefix_caching: bool
) -> ShapeModel:
    profile = Profile.load(path)
    limits = EngineLimits(profile.max_num_batched_tokens, profile.max_num_seqs, block_size, prefix_caching)
    return simulated(profile, SLO(ttft_ms=ttft_ms, tpot_ms=itl_ms), limits)


__all__ = ["from_manifest", "load_trace", "simulated"]
