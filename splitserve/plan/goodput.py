"""A simulated run's figures, by `splitserve bench`'s definitions (ab/metrics.py): TTFT, TPOT, ITL
and e2e percentiles; goodput = requests that met every SLO / (first send to last answer); SLO
attainment; cost per accepted response = devices x USD per device-hour x duration / accepted."""

from __future__ import annotations

import math
from dataclasses import dataclass

from splitserve.ab.metrics import SLO, cost_per_accepted, stats_ms
from splitserve.plan.simulator import RequestRecord, SimRun


@dataclass(frozen=True)
class RunFigures:
    name: str
    devices: int
    requests: int
    good: int
    duration_s: float
    goodput_rps: float
    attainment: float
    usd_per_accepted: float
    ttft_ms: dict[str, float]
    tpot_ms: dict[str, float]
    itl_ms: dict[str, float]
    e2el_ms: dict[str, float]
    transfer_ms: dict[str, float]
    busy: dict[str, float]  # each worker's share of the run it spent stepping

    @property
    def goodput_per_device(self) -> float:
        return self.goodput_rps / self.devices if self.devices else math.nan

    def to_json(self) -> dict:
        return {**self.__dict__, "goodput_per_device": self.goodput_per_device}


def meets(rec: RequestRecord, slo: SLO) -> bool:
    """As `ab.metrics.meets_slo`: a request of one token has no TPOT (counted as 0)."""
    checks = ((slo.ttft_ms, rec.ttft_s), (slo.tpot_ms, rec.tpot_s or 0.0), (slo.e2e_ms, rec.e2e_s))
    return all(limit is None or value * 1e3 <= limit for limit, value in checks)


def figures(run: SimRun, slo: SLO, usd_per_device_hour: float) -> RunFigures:
    recs = run.records
    good = sum(meets(r, slo) for r in recs)
    dur = run.duration_s
    devices = run.deployment.devices
    tpots = [t for r in recs if (t := r.tpot_s) is not None]
    busy = {r.name: (r.busy_s / dur if dur > 0 else 0.0) for r in run.replicas}
    return RunFigures(
        name=run.deployment.name,
        devices=devices,
        requests=len(recs),
        good=good,
        duration_s=dur,
        goodput_rps=good / max(dur, 1e-9),
        attainment=good / len(recs) if recs else math.nan,
        usd_per_accepted=cost_per_accepted(devices * usd_per_device_hour, dur, good),
        ttft_ms=stats_ms([r.ttft_s for r in recs]),
        tpot_ms=stats_ms(tpots),
        itl_ms=stats_ms([g for r in recs for g in r.itl_s]),
        e2el_ms=stats_ms([r.e2e_s for r in recs]),
        transfer_ms=stats_ms([r.transfer_s for r in recs if r.transfer_s > 0]),
        busy=busy,
    )


__all__ = ["RunFigures", "figures", "meets"]
