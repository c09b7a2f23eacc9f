"""The planner against measurement: `splitserve plan`'s simulator, on a saved profile, replays the very
traces `splitserve bench` runs sent (their trace-<i>.jsonl files: arrival times, prompt and output
lengths) on each target's deployment (colocated N, or P prefill + D decode, read off the report), and
prints predicted beside measured for goodput, TTFT p50/p90 and TPOT p50/p90, with the error of each.
Workers pinned to cores of their own (`runtime.pin_cores`), the profile timed pinned as well, and the
router least-loaded (the simulated router's policy):

    splitserve plan --profile-only --pin-cores --save-profile bench/results/profile-pinned.json \
        examples/colocated.yaml
    PIN="--set runtime.pin_cores=true --set router.policy=least_loaded"
    splitserve bench examples/colocated.yaml --set colocated.replicas=2 $PIN \
        --request-rates 0.25 0.5 1 --num-prompts 16 --out bench/results/plan-colocated
    splitserve bench examples/disaggregated.yaml $PIN \
        --request-rates 0.25 0.5 1 --num-prompts 16 --out bench/results/plan-disaggregated
    python bench/plan_vs_bench.py bench/results/plan-colocated bench/results/plan-disaggregated \
        --profile bench/results/profile-pinned.json

Goal: every cell within 15%. Prompts are random ids (no prefix-cache hits either way); the simulator
does not model KV-capacity preemption; docs/plan.md says which cells miss and why.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from collections import Counter
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from splitserve.ab.metrics import SLO  # noqa: E402
from splitserve.ab.workload import load_trace  # noqa: E402
from splitserve.plan.goodput import figures  # noqa: E402
from splitserve.plan.profile import Profile  # noqa: E402
from splitserve.plan.replica import EngineLimits  # noqa: E402
from splitserve.plan.simulator import Deployment, simulate  # noqa: E402

GOAL = 0.15
CELLS = (
    ("goodput", lambda f: f.goodput_rps, lambda m: m["goodput_rps"]),
    ("TTFT p50", lambda f: f.ttft_ms["p50"], lambda m: m["ttft_ms"]["p50"]),
    ("TTFT p90", lambda f: f.ttft_ms["p90"], lambda m: m["ttft_ms"]["p90"]),
    ("TPOT p50", lambda f: f.tpot_ms["p50"], lambda m: m["tpot_ms"]["p50"]),
    ("TPOT p90", lambda f: f.tpot_ms["p90"], lambda m: m["tpot_ms"]["p90"]),
)


def deployment_of(target: dict, limits: EngineLimits) -> Deployment:
    roles = Counter(w["role"] for w in target["hardware"]["workers"])
    if roles.get("colocated"):
        return Deployment.colocated(roles["colocated"], limits)
    return Deployment.split(roles["prefill"], roles["decode"], limits)


def compare(folder: Path, profile: Profile, limits: EngineLimits) -> list[dict]:
    report = json.loads((folder / "report.json").read_text())
    slo = SLO(**report["config"]["slo"])
    rows = []
    for target in report["targets"]:
        dep = deployment_of(target, limits)
        for i, point in enumerate(target["points"]):
            path = folder / f"trace-{i}.jsonl"
            trace = load_trace(path, max_model_len=1 << 20)  # arrivals from its first request's ...
            t0 = json.loads(path.read_text().splitlines()[0])["timestamp"]
            trace = [replace(r, arrival_s=r.arrival_s + t0) for r in trace]  # ... back to the run's start
            fig = figures(simulate(trace, dep, profile.cost), slo, 0.0)
            measured = point["metrics"]
            for name, pred, meas in CELLS:
                p, m = pred(fig), meas(measured)
                err = (p - m) / m if m else math.nan
                rows.append({"run": folder.name, "deployment": dep.name, "rate": point["rate"],
                             "metric": name, "predicted": p, "measured": m, "error": err})  # fmt: skip
    return rows


def table(rows: list[dict]) -> str:
    keys = ("run", "deployment", "rate", "metric", "predicted", "measured", "error")
    lines = ["{:<22} {:<13} {:>5} {:<9} {:>10} {:>10} {:>8}".format(*keys)]
    for r in rows:
        ok = "" if abs(r["error"]) <= GOAL else "  (past 15%)"
        lines.append(
            "{:<22} {:<13} {:>5g} {:<9} {:>10.3f} {:>10.3f} {:>+8.1%}".format(*(r[k] for k in keys)) + ok
        )
    inside = sum(abs(r["error"]) <= GOAL for r in rows)
    lines.append(f"{inside} of {len(rows)} cells within {GOAL:.0%} (goodput in req/s, latencies in ms)")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "reports", nargs="+", help="`splitserve bench` output folders (report.json, trace-<i>.jsonl)"
    )
    ap.add_argument("--profile", required=True, help="a saved profile (splitserve plan --save-profile)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048, help="the bench manifests' engine")
    ap.add_argument("--max-num-seqs", type=int, default=64)
    ap.add_argument("--json", default=None, help="also write the rows here")
    args = ap.parse_args()
    profile = Profile.load(args.profile)
    limits = EngineLimits(args.max_num_batched_tokens, args.max_num_seqs, profile.block_size)
    print(profile.describe())
    rows = [row for folder in args.reports for row in compare(Path(folder), profile, limits)]
    print(table(rows))
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
