"""The planner's search: every deployment a budget of N devices allows (colocated 1..N replicas, and
every x prefill + y decode workers with x + y <= N), each simulated on the same trace, ranked.

The choice: among the deployments whose SLO attainment reaches the target (90% of requests met
every SLO, DistServe's criterion), the one with the lowest cost per accepted response (at one price
per device, that is the highest goodput per device); ties go to the higher goodput, then to fewer
devices. When none reaches the target, the one with the highest goodput, said so. Its margin is
measured against the runner-up by the same criterion.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.ab.metrics import SLO
from splitserve.ab.workload import BenchRequest
from splitserve.plan.cost import StepCost
from splitserve.plan.goodput import RunFigures, figures
from splitserve.plan.replica import EngineLimits
from splitserve.plan.simulator import Deployment, simulate


def candidates(
    devices: int, limits: Callable[[str], EngineLimits], first_token: str = "prefill"
) -> list[Deployment]:
    """Colocated 1..devices, then every xP:yD with x + y <= devices. `limits(role)`: a role's knobs;
    `first_token`: the router's `router.first_token` (when a split's first token streams)."""
    if devices < 1:
        raise ValueError("--devices must be at least 1")
    out = [Deployment(0, n, limits("colocated")) for n in range(1, devices + 1)]
    for total in range(2, devices + 1):
        for p in range(1, total):
            out.append(
                Deployment(p, total - p, limits("decode"), limits("prefill"), limits("decode"), first_token)
            )
    return out


@dataclass(frozen=True)
class Choice:
    best: RunFigures
    deployment: Deployment
    runner_up: RunFigures | None
    meets_target: bool
    # meeting the target: the runner-up's cost per accepted response / the best's - 1; else the best's
    # goodput / the runner-up's - 1 (inf where the runner-up has none)
    margin: float

    def sentence(self, target: float) -> str:
        b = self.best
        head = (
            f"best: {b.name} ({b.devices} device{'s' * (b.devices > 1)}): goodput {b.goodput_rps:.3f} req/s, "
            f"{b.goodput_per_device:.3f} per device, {b.attainment:.0%} of requests within the SLOs, "
            f"${b.usd_per_accepted * 1000:.4f} per 1,000 accepted"
        )
        if not self.meets_target:
            head += f" (no deployment reaches {target:.0%} attainment: ranked by goodput)"
        if self.runner_up is None:
            return head + "; no runner-up"
        r = self.runner_up
        margin = "inf" if math.isinf(self.margin) else f"{self.margin:.1%}"
        what = "cheaper per accepted response" if self.meets_target else "more goodput"
        return (
            head + f"; {margin} {what} than the runner-up, {r.name} "
            f"(goodput {r.goodput_rps:.3f} req/s, {r.attainment:.0%} attainment, "
            f"${r.usd_per_accepted * 1000:.4f} per 1,000 accepted)"
        )


def _rank_key(f: RunFigures, target: float) -> tuple:
    meets = f.attainment >= target
    if meets:
        return (0, f.usd_per_accepted, -f.goodput_rps, f.devices)
    return (1, -f.goodput_rps, f.usd_per_accepted, f.devices)


def evaluate(
    trace: Sequence[BenchRequest],
    deployments: Sequence[Deployment],
    cost: StepCost,
    slo: SLO,
    usd_per_device_hour: float,
) -> list[tuple[Deployment, RunFigures]]:
    return [(d, figures(simulate(trace, d, cost), slo, usd_per_device_hour)) for d in deployments]


def choose(rows: Sequence[tuple[Deployment, RunFigures]], target: float = 0.9) -> Choice:
    ranked = sorted(rows, key=lambda r: _rank_key(r[1], target))
    (dep, best), rest = ranked[0], ranked[1:]
    runner = rest[0][1] if rest else None
    meets = best.attainment >= target
    margin = math.nan
    if runner is not None and meets:
        margin = runner.usd_per_accepted / best.usd_per_accepted - 1
    elif runner is not None:
        margin = best.goodput_rps / runner.goodput_rps - 1 if runner.goodput_rps > 0 else math.inf
    return Choice(best, dep, runner, meets, margin)


__all__ = ["Choice", "candidates", "choose", "evaluate"]
