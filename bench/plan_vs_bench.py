"""The planner against measurement: `splitserve plan`'s simulator, on a saved profile, replays the very
traces `splitserve bench` runs sent (their trace-<i>.jsonl files: arrival times, prompt and output
lengths) on each target's deployment (colocated N, or P prefill + D decode, read off the report), and
prints predicted beside measured for goodput, TTFT p50/p90 and TPOT p50/p90, with the error of each.
Workers pinned to cores of their own (`runtime.pin_cores`), the profiles timed pinned as well, the
router least-loaded (the simulated router's policy), no spare worker process:

    PIN="--set runtime.pin_cores=true --set router.policy=least_loaded --set runtime.standby=false"
    splitserve bench examples/colocated.yaml --set colocated.replicas=2 $PIN \
        --request-rates 0.25 0.5 1 --num-prompts 32 --out bench/results/plan-check/colocated-a
    splitserve bench examples/disaggregated.yaml $PIN \
        --request-rates 0.25 0.5 1 --num-prompts 32 --out bench/results/plan-check/disaggregated-a
    splitserve plan --profile-only --pin-cores --save-profile bench/results/plan-check/profile-2.json \
        examples/colocated.yaml      # and more profiles, at other moments
    python bench/plan_vs_bench.py bench/results/plan-check/{colocated,disaggregated}-a \
        --profile bench/results/plan-check/profile-*.json --pool

Goal: every cell within 15%. Prompts are random ids (no prefix-cache hits either way); the simulator
does not model KV-capacity preemption; docs/plan.md says which cells miss and why.

How the cells are checked:
- A p90 is printed with the 90% confidence interval of the measured p90 (a bootstrap over the point's
  requests): with 32 requests it is a value near the top few, and the interval says how far two runs
  of the same trace can put it. A cell past 15% whose prediction lies inside that interval is marked
  "in CI": the measurement cannot tell the prediction wrong.
- A point is saturated when its time to first token grows through the run: the median TTFT of the
  last third of its requests (by arrival) over that of the first third is more than `SATURATED`.
  A pool that is offered more work than it serves queues without bound, so its TTFT percentiles and
  goodput are a function of the run's length and of a few per cent of service speed compounding over
  it, and two runs of one trace differ by far more than 15%. A saturated point (predicted or
  measured) is checked on the verdict (saturated: predicted as measured) and on its throughput
  (completed requests per second: what the saturated pool serves, which is stable); its TTFT and
  goodput are printed, not counted. Its TPOT, set by the pool that is not saturated, is counted.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from splitserve.ab.metrics import SLO, tpot_s  # noqa: E402
from splitserve.ab.workload import load_trace  # noqa: E402
from splitserve.plan.goodput import figures  # noqa: E402
from splitserve.plan.profile import Profile, pooled  # noqa: E402
from splitserve.plan.replica import EngineLimits  # noqa: E402
from splitserve.plan.simulator import Deployment, simulate  # noqa: E402

GOAL = 0.15
SATURATED = 2.0  # the last third's median TTFT over the first third's, past which a point is saturated
CELLS = (
    ("goodput", lambda f: f.goodput_rps, lambda m: m["goodput_rps"]),
    ("TTFT p50", lambda f: f.ttft_ms["p50"], lambda m: m["ttft_ms"]["p50"]),
    ("TTFT p90", lambda f: f.ttft_ms["p90"], lambda m: m["ttft_ms"]["p90"]),
    ("TPOT p50", lambda f: f.tpot_ms["p50"], lambda m: m["tpot_ms"]["p50"]),
    ("TPOT p90", lambda f: f.tpot_ms["p90"], lambda m: m["tpot_ms"]["p90"]),
)
SATURATED_DROPS = ("goodput", "TTFT p50", "TTFT p90")  # printed, not counted, at a saturated point
BREAKDOWN: list[str] = []  # each point's first-token breakdown (`breakdown`), for --breakdown


def deployment_of(target: dict, limits: EngineLimits, first_token: str) -> Deployment:
    roles = Counter(w["role"] for w in target["hardware"]["workers"])
    if roles.get("colocated"):
        return Deployment.colocated(roles["colocated"], limits)
    return Deployment.split(roles["prefill"], roles["decode"], limits, first_token)


def growth(pairs: list[tuple[float, float]]) -> float:
    """(arrival, TTFT) of a point's requests -> the last third's median TTFT over the first third's."""
    ttft = [t for _, t in sorted(pairs)]
    k = max(1, len(ttft) // 3)
    return statistics.median(ttft[-k:]) / statistics.median(ttft[:k])


def p90_interval(values_ms: list[float], reps: int = 2000) -> tuple[float, float]:
    """The 90% bootstrap interval of the p90 of `values_ms` (seeded: a function of its input)."""
    x = np.asarray(values_ms, dtype=float)
    rng = np.random.default_rng(0)
    p90s = np.percentile(x[rng.integers(0, x.size, (reps, x.size))], 90, axis=1)
    return float(np.percentile(p90s, 5)), float(np.percentile(p90s, 95))


def measured_requests(folder: Path, target: dict, rate: float) -> list[dict]:
    path = folder / "requests" / f"{target['name']}-{rate:g}_req_s.jsonl"
    return [r for r in map(json.loads, path.read_text().splitlines()) if r["success"]]


def _row(folder: Path, dep: Deployment, rate: float, metric: str, p: float, m: float, **kw) -> dict:
    err = (p - m) / m if m else math.nan
    return {"run": folder.name, "deployment": dep.name, "rate": rate, "metric": metric, "predicted": p,
            "measured": m, "error": err, "ci": None, "counted": True, **kw}  # fmt: skip


def point_rows(folder: Path, dep: Deployment, point: dict, fig, sim, reqs: list[dict]) -> list[dict]:  # noqa: ANN001
    rate, measured = point["rate"], point["metrics"]
    pred_growth = growth([(r.arrival_s, r.ttft_s) for r in sim.records])
    meas_growth = growth([(r["start_s"], r["ttft_s"]) for r in reqs])
    saturated = pred_growth > SATURATED or meas_growth > SATURATED
    per_request = {
        "TTFT p90": [r["ttft_s"] * 1e3 for r in reqs],
        "TPOT p90": [
            t * 1e3 for r in reqs if (t := tpot_s(r["latency_s"], r["ttft_s"], len(r["itl_s"]) + 1))
        ],
    }
    rows = []
    if saturated:
        rows.append(_row(folder, dep, rate, "saturated", float(pred_growth > SATURATED),
                         float(meas_growth > SATURATED), growth=(pred_growth, meas_growth)))  # fmt: skip
        rows[-1]["error"] = 0.0 if rows[-1]["predicted"] == rows[-1]["measured"] else math.inf
        rows.append(_row(folder, dep, rate, "throughput", len(sim.records) / sim.duration_s,
                         measured["request_throughput"]))  # fmt: skip
    for name, pred, meas in CELLS:
        row = _row(folder, dep, rate, name, pred(fig), meas(measured))
        row["counted"] = not (saturated and name in SATURATED_DROPS)
        if name in per_request and len(per_request[name]) > 1:
            row["ci"] = p90_interval(per_request[name])
        rows.append(row)
    return rows


def breakdown(folder: Path, rate: float, reqs: list[dict], profile: Profile) -> str:
    """Where the measured first token's time went, against the model, over the point's lone requests
    (no other request in flight from its send to its first token; the router's own timings,
    x-splitserve-ttft-*): the router's prefill time over
    the profile's prefill step for its length (served factor included), and what lies outside the
    router's queue and prefill (the load client, the router, HTTP) against the profile's request_s."""
    c = profile.cost

    def alone(r: dict) -> bool:
        a, b = r["start_s"], r["start_s"] + r["ttft_s"]
        return all(o is r or o["start_s"] >= b or o["start_s"] + o["latency_s"] <= a for o in reqs)

    lone = [r for r in reqs if alone(r) and "prefill" in r.get("server_ms", {})]
    if not lone:
        return f"{folder.name:<22} {rate:>5g}: no lone request"
    ratio = [r["server_ms"]["prefill"] / (c.prefill_s(r["prompt_len"]) * 1e3) for r in lone]
    outside = [r["ttft_s"] * 1e3 - r["server_ms"]["queue"] - r["server_ms"]["prefill"] for r in lone]
    return (
        f"{folder.name:<22} {rate:>5g}: {len(lone)} lone requests: the router's prefill "
        f"x{statistics.median(ratio):.3f} the profile's (spread {min(ratio):.2f}-{max(ratio):.2f}); "
        f"outside it {statistics.median(outside):.1f} ms (the profile: {c.request_s * 1e3:.1f} ms)"
    )


def compare(folder: Path, profile: Profile, limits: EngineLimits, first_token: str) -> list[dict]:
    report = json.loads((folder / "report.json").read_text())
    slo = SLO(**report["config"]["slo"])
    rows = []
    for target in report["targets"]:
        dep = deployment_of(target, limits, first_token)
        for i, point in enumerate(target["points"]):
            path = folder / f"trace-{i}.jsonl"
            trace = load_trace(path, max_model_len=1 << 20)  # arrivals from its first request's ...
            t0 = json.loads(path.read_text().splitlines()[0])["timestamp"]
            trace = [replace(r, arrival_s=r.arrival_s + t0) for r in trace]  # ... back to the run's start
            sim = simulate(trace, dep, profile.cost)
            reqs = measured_requests(folder, target, point["rate"])
            rows += point_rows(folder, dep, point, figures(sim, slo, 0.0), sim, reqs)
            BREAKDOWN.append(breakdown(folder, point["rate"], reqs, profile))
    return rows


def verdict(r: dict) -> str:
    if not r["counted"]:
        return "  (saturated: not counted)"
    if abs(r["error"]) <= GOAL:
        return ""
    ci = r["ci"]
    return "  (past 15%, in CI)" if ci and ci[0] <= r["predicted"] <= ci[1] else "  (past 15%)"


def table(rows: list[dict]) -> str:
    keys = ("run", "deployment", "rate", "metric", "predicted", "measured", "error")
    lines = ["{:<22} {:<13} {:>5} {:<10} {:>10} {:>10} {:>8}  {}".format(*keys, "measured p90's 90% CI")]
    for r in rows:
        ci = f"{r['ci'][0]:.0f}-{r['ci'][1]:.0f}" if r["ci"] else ""
        if r["metric"] == "saturated":
            pm = ["saturated" if r[k] else "no" for k in ("predicted", "measured")]
            g = "TTFT x{:.1f} / x{:.1f} last third over first".format(*r["growth"])
            lines.append(f"{r['run']:<22} {r['deployment']:<13} {r['rate']:>5g} {'saturated':<10} "
                         f"{pm[0]:>10} {pm[1]:>10} {'':>8}  {g}{verdict(r)}")  # fmt: skip
            continue
        lines.append(
            "{:<22} {:<13} {:>5g} {:<10} {:>10.3f} {:>10.3f} {:>+8.1%}".format(*(r[k] for k in keys))
            + f"  {ci}{verdict(r)}"
        )
    lines.append(summary(rows) + " (goodput and throughput in req/s, latencies in ms)")
    return "\n".join(lines)


def markdown(rows: list[dict]) -> str:
    """docs/plan.md's table: a row per deployment and rate, a cell per metric: predicted / measured in
    each run (the runs replay one trace, so one prediction), the errors after; x: past 15% and
    counted; s: a saturated point's cell, not counted."""
    cells: dict[tuple, dict[str, list[dict]]] = {}
    for r in rows:
        cells.setdefault((r["deployment"], r["rate"]), {}).setdefault(r["metric"], []).append(r)
    names = [n for n, *_ in CELLS] + (
        ["throughput"] if any(r["metric"] == "throughput" for r in rows) else []
    )
    out = ["| deployment | rate | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for (dep, rate), by_metric in cells.items():
        row = [dep, f"{rate:g}"]
        for name in names:
            rs = by_metric.get(name, [])
            if not rs:
                row.append("")
                continue
            fmt = (
                "{:.3f}"
                if name in ("goodput", "throughput")
                else "{:.0f}"
                if rs[0]["measured"] > 100
                else "{:.1f}"
            )
            errs = ", ".join(
                f"{r['error']:+.0%}"
                + (" **s**" if not r["counted"] else " **x**" if abs(r["error"]) > GOAL else "")
                for r in rs
            )
            meas = ", ".join(fmt.format(r["measured"]) for r in rs)
            row.append(f"{fmt.format(rs[0]['predicted'])} / {meas} ({errs})")
        out.append("| " + " | ".join(row) + " |")
    return "\n".join(out)


def summary(rows: list[dict]) -> str:
    counted = [r for r in rows if r["counted"]]
    inside = sum(abs(r["error"]) <= GOAL for r in counted)
    in_ci = sum(verdict(r).endswith("in CI)") for r in counted)
    return (f"{inside} of {len(counted)} cells within {GOAL:.0%}, {in_ci} more past it but inside the "
            f"measured p90's 90% confidence interval")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "reports", nargs="+", help="`splitserve bench` output folders (report.json, trace-<i>.jsonl)"
    )
    ap.add_argument(
        "--profile",
        required=True,
        nargs="+",
        help="saved profiles (splitserve plan --save-profile): the table for the first, a count for "
        "each, so that profiles taken at other times can be compared",
    )
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the bench manifests' engine")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--first-token", choices=("prefill", "decode"), default="prefill",
                    help="the deployments' router.first_token (the router's default: prefill)")  # fmt: skip
    ap.add_argument("--json", default=None, help="also write the rows here")
    ap.add_argument(
        "--breakdown", action="store_true", help="also print where each point's first-token time went"
    )
    ap.add_argument("--markdown", action="store_true", help="also print docs/plan.md's table")
    ap.add_argument(
        "--pool", action="store_true", help="the table for the profiles pooled (each coefficient's median)"
    )
    args = ap.parse_args()
    profiles = [(path, Profile.load(path)) for path in args.profile]
    if args.pool:
        profiles.insert(0, ("pooled", pooled([p for _, p in profiles])))
    for i, (path, profile) in enumerate(profiles):
        limits = EngineLimits(args.max_num_batched_tokens, args.max_num_seqs, profile.block_size)
        rows = [
            r for folder in args.reports for r in compare(Path(folder), profile, limits, args.first_token)
        ]
        if i == 0:
            print(profile.describe())
            print(table(rows))
            if args.breakdown:
                print("\n".join(BREAKDOWN))
            if args.markdown:
                print(markdown(rows))
            if args.json:
                Path(args.json).write_text(json.dumps(rows, indent=1))
        else:
            print(f"{path}: {summary(rows)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
