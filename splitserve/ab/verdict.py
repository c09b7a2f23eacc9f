"""The verdict on a candidate deployment against the baseline (the first target): trial, wait or reject.

The rules, in the order they are applied (the report prints them beside the evidence):

  R0 wait    the comparison cannot be made: a run failed, or neither side met its SLOs at any rate.
  R1 trial   at some swept rate the candidate's goodput per dollar (goodput / the deployment's USD per
             hour; at equal hardware, plain goodput) beats the baseline's by more than the margin, with
             the ratio's 90% bootstrap interval above 1 (outside noise), and at no rate is it worse
             that way.
  R2 reject  at some rate it is worse by more than the margin, outside noise, and at no rate better.
             The cause named: transfer overhead (the KV transfer takes >= 20% of the candidate's TTFT),
             idle duplication (the candidate pays for more devices and does not earn them back), or
             plain lower goodput.
  R3 wait    otherwise: every difference inside the margin or the noise, or better at one rate and
             worse at another.

Noise: sampling noise (requests resampled for the interval), and the machine's: a difference at a rate
does not count when other processes on the host used more than `max_interference_cores` more CPU
during one side's run than during the other's (measured, for deployments this run started). Repeating
the run is the honest check.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from splitserve.ab.metrics import bootstrap_ratio, distserve_goodput

TRANSFER_SHARE = 0.20  # KV transfer share of TTFT above which a loss is put down to transfer overhead
MIN_GOOD = 3  # a side with no good request beats one with at least this many, at a rate


@dataclass(frozen=True)
class VerdictConfig:
    margin: float = 0.10
    attainment_target: float = 0.90
    seed: int = 0
    max_interference_cores: float = 0.25


@dataclass
class Verdict:
    candidate: str
    baseline: str
    verdict: str  # trial | wait | reject
    rule: str
    reasons: list[str]
    equal_hardware: bool
    rows: list[dict] = field(default_factory=list)  # per rate: the evidence
    distserve: dict[str, float | None] = field(default_factory=dict)

    def to_json(self) -> dict:
        return dict(self.__dict__)


def rules_text(cfg: VerdictConfig) -> list[str]:
    m = f"{cfg.margin:.0%}"
    return [
        "R0 wait: a run failed, or neither side met its SLOs at any rate: no comparison.",
        f"R1 trial: at some rate the candidate's goodput per dollar beats the baseline's by more than {m} "
        "with the 90% bootstrap interval of the ratio above 1, and at no rate is it worse that way.",
        f"R2 reject: at some rate it is worse by more than {m} (interval below 1) and at no rate better; "
        f"cause: transfer overhead (KV transfer >= {TRANSFER_SHARE:.0%} of TTFT), idle duplication "
        "(more devices, not earned back), or lower goodput.",
        "R3 wait: otherwise (inside margin or noise, or mixed). A difference at a rate does not count "
        f"when other processes on the host used more than {cfg.max_interference_cores:g} cores more CPU "
        "during one side's run than during the other's (machine noise).",
    ]


def compare_point(cand: dict, base: dict, cfg: VerdictConfig) -> dict:
    """One rate: goodput per dollar of each side, their ratio with its interval, and the class."""
    cm, bm = cand["metrics"], base["metrics"]
    sc = 1.0 / (max(cm["duration_s"], 1e-9) * cand["usd_per_hour"])
    sb = 1.0 / (max(bm["duration_s"], 1e-9) * base["usd_per_hour"])
    ratio, lo, hi = bootstrap_ratio(
        cm["good"], cm["requests"], sc, bm["good"], bm["requests"], sb, seed=cfg.seed
    )
    if bm["good"] == 0:
        cls = "better" if cm["good"] >= MIN_GOOD else "same"
        ratio = math.inf if cm["good"] else math.nan
    elif ratio > 1 + cfg.margin and lo > 1:
        cls = "better"
    elif ratio < 1 - cfg.margin and hi < 1:
        cls = "worse"
    else:
        cls = "same"
    if cm["good"] == 0 and bm["good"] >= MIN_GOOD:
        cls = "worse"
    other_c = cand.get("util", {}).get("cpu_other_cores", math.nan)
    other_b = base.get("util", {}).get("cpu_other_cores", math.nan)
    interference = abs(other_c - other_b)  # NaN (unknown) never flags
    if cls != "same" and interference > cfg.max_interference_cores:
        cls = "noisy"
    return {
        "rate": cand["rate"],
        "baseline_goodput_rps": bm["goodput_rps"],
        "candidate_goodput_rps": cm["goodput_rps"],
        "baseline_attainment": bm["slo_attainment"],
        "candidate_attainment": cm["slo_attainment"],
        "ratio_per_usd": ratio,
        "ci90": [lo, hi],
        "class": cls,
        "candidate_kv_share": cand.get("server", {}).get("kv_share_of_ttft", math.nan),
        "other_cpu_cores": [other_c, other_b],  # candidate, baseline
    }


def decide(candidate: dict, baseline: dict, cfg: VerdictConfig) -> Verdict:
    """candidate / baseline: a target's results (report.target_json): name, hardware, points."""
    equal = candidate["hardware"].get("devices") == baseline["hardware"].get("devices")
    v = Verdict(candidate["name"], baseline["name"], "wait", "R0", [], equal)
    if candidate.get("error") or baseline.get("error"):
        v.reasons.append(
            "a run failed: " + "; ".join(filter(None, (candidate.get("error"), baseline.get("error"))))
        )
        return v
    by_rate = {_key(p["rate"]): p for p in baseline["points"]}
    for p in candidate["points"]:
        b = by_rate.get(_key(p["rate"]))
        if b is not None:
            p = {**p, "usd_per_hour": candidate["hardware"]["usd_per_hour"]}
            b = {**b, "usd_per_hour": baseline["hardware"]["usd_per_hour"]}
            v.rows.append(compare_point(p, b, cfg))
    for t in (candidate, baseline):
        pts = [(p["rate"], p["metrics"]["slo_attainment"]) for p in t["points"] if p["rate"] is not None]
        v.distserve[t["name"]] = distserve_goodput(pts, cfg.attainment_target)
    if not v.rows or all(r["baseline_goodput_rps"] == 0 and r["candidate_goodput_rps"] == 0 for r in v.rows):
        v.reasons.append("no rate where either side met its SLOs (relax the SLOs or lower the rates)")
        return v
    better = [r for r in v.rows if r["class"] == "better"]
    worse = [r for r in v.rows if r["class"] == "worse"]
    basis = "goodput" if equal else "goodput per dollar"
    if better and not worse:
        v.verdict, v.rule = "trial", "R1"
        v.reasons.append(f"{basis} higher beyond the margin at {_rates(better)}")
    elif worse and not better:
        v.verdict, v.rule = "reject", "R2"
        v.reasons.append(f"{basis} lower beyond the margin at {_rates(worse)}")
        v.reasons += _causes(candidate, baseline, worse)
    else:
        v.rule = "R3"
        noisy = [r for r in v.rows if r["class"] == "noisy"]
        if noisy:
            v.reasons.append(
                "machine noise at "
                + ", ".join(
                    f"{_rates([r])} (other processes: {r['other_cpu_cores'][0]:.2f} vs "
                    f"{r['other_cpu_cores'][1]:.2f} cores)"
                    for r in noisy
                )
            )
        if better and worse:
            v.reasons.append(f"mixed: better at {_rates(better)}, worse at {_rates(worse)}")
        elif not noisy:
            v.reasons.append(f"{basis} within {cfg.margin:.0%} or inside the noise at every rate")
    if not equal:
        v.reasons.append(
            f"hardware differs ({_devices(candidate)} vs {_devices(baseline)}): compared per dollar"
        )
    return v


def _causes(candidate: dict, baseline: dict, worse: list[dict]) -> list[str]:
    causes = []
    shares = [r["candidate_kv_share"] for r in worse if not math.isnan(r["candidate_kv_share"])]
    if shares and max(shares) >= TRANSFER_SHARE:
        causes.append(f"transfer overhead: KV transfer is up to {max(shares):.0%} of the candidate's TTFT")
    n_c = sum(candidate["hardware"]["devices"].values())
    n_b = sum(baseline["hardware"]["devices"].values())
    if n_c > n_b:
        causes.append(
            f"idle duplication: {n_c} devices against {n_b}, and the extra ones did not pay for themselves"
        )
    return causes or ["lower goodput at the same cost"]


def _key(rate: float | None) -> str:
    return "recorded" if rate is None else f"{rate:.6g}"


def _rates(rows: list[dict]) -> str:
    return ", ".join("as recorded" if r["rate"] is None else f"{r['rate']:g} req/s" for r in rows)


def _devices(t: dict) -> str:
    return " + ".join(f"{n} {kind}" for kind, n in sorted(t["hardware"]["devices"].items())) or "unknown"


__all__ = ["Verdict", "VerdictConfig", "compare_point", "decide", "rules_text"]
