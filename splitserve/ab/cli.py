"""`splitserve bench`: the colocated-versus-disaggregated A/B, with goodput, cost and a verdict.

    splitserve bench examples/colocated.yaml examples/disaggregated.yaml --request-rates 0.5 1 2
    splitserve bench examples/disaggregated.yaml --modes colocated disaggregated --set colocated.replicas=2
    splitserve bench http://127.0.0.1:8000 http://127.0.0.1:8001 --workload agent
    splitserve bench colo=http://127.0.0.1:8000 --workload replay --trace trace.jsonl

Each TARGET is a manifest (started on a free port, benchmarked, stopped) or a running endpoint's URL,
optionally named `NAME=TARGET`. The first target is the baseline; each other one gets a verdict against
it. Every target sees the identical trace at each rate (each rate its own prompts, so that no prefix
cache answers a prompt from an earlier rate). The report (report.html, report.json, PNG
plots, per-request records) goes into --out; a short summary is printed at the end. Exit status: 0,
1 if the run itself failed (a target did not start or answer, or none of its requests succeeded),
2 for bad arguments.
"""

from __future__ import annotations

import argparse
import datetime as dt
import math
import shlex
import sys
from pathlib import Path

from splitserve.ab.metrics import SLO
from splitserve.ab.runner import RunOptions, Target, run_targets
from splitserve.ab.verdict import VerdictConfig, decide, rules_text
from splitserve.ab.workload import WORKLOADS, LengthDist, WorkloadSpec, at_rate, sweep_traces, write_trace

GATE_NOT_RUN = {
    "status": "gate not run",
    "detail": "--skip-verify: `splitserve verify` did not check, before this comparison, that the "
    "deployments answer correctly and move KV over their required backends",
}


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "bench",
        help="A/B benchmark of deployments (colocated vs disaggregated): goodput, cost, verdict",
        description=__doc__.split("\n")[0],
    )
    p.add_argument(
        "targets", nargs="+", metavar="TARGET", help="a manifest YAML or an http(s) URL; NAME=TARGET"
    )
    p.add_argument(
        "--modes",
        nargs="+",
        choices=("colocated", "disaggregated"),
        default=None,
        help="run each manifest once per mode (the same manifest colocated and disaggregated)",
    )
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="FIELD=VALUE",
        help="override a manifest field for every manifest target, e.g. colocated.replicas=2",
    )
    w = p.add_argument_group("workload")
    w.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    w.add_argument("--num-prompts", type=int, default=40, help="requests per rate")
    w.add_argument(
        "--input-len", default="uniform:128:512", help="fixed:N | uniform:LO:HI | lognormal:MEDIAN:SIGMA"
    )
    w.add_argument("--output-len", default="uniform:32:64", help="the same forms")
    w.add_argument(
        "--request-rates",
        nargs="+",
        type=float,
        default=None,
        help="req/s to sweep (inf: all at once); default 0.5 1 2, a replay: as recorded",
    )
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument(
        "--trace", default=None, help="replay: JSONL of {timestamp, prompt | prompt_len, output_len}"
    )
    w.add_argument(
        "--long-fraction", type=float, default=0.3, help="long-mix: share of rag/summarize requests"
    )
    w.add_argument("--system-prompt-len", type=int, default=256, help="agent: prefix shared by all sessions")
    w.add_argument("--turns", default="2:5", help="agent: turns per session, LO:HI")
    w.add_argument("--think-s", type=float, default=1.0, help="agent: mean think time between turns")
    w.add_argument("--max-model-len", type=int, default=None, help="default: the first manifest's, else 2048")
    w.add_argument("--vocab", default="100:32000", help="random prompt token ids from [LO, HI)")
    s = p.add_argument_group("SLOs, cost and verdict")
    s.add_argument(
        "--slo-ttft-ms", type=float, default=None, help="default: the first manifest's slos.ttft_ms"
    )
    s.add_argument(
        "--slo-tpot-ms", type=float, default=None, help="default: the first manifest's slos.itl_ms"
    )
    s.add_argument("--slo-e2e-ms", type=float, default=None)
    s.add_argument("--attainment-target", type=float, default=0.9)
    s.add_argument("--margin", type=float, default=0.10, help="a gain or loss smaller than this is no change")
    s.add_argument(
        "--max-interference-cores",
        type=float,
        default=0.25,
        help="a difference at a rate does not count when other processes' CPU use differed more than this",
    )
    s.add_argument(
        "--usd-per-hour",
        action="append",
        default=[],
        metavar="KIND=USD",
        help="device price (default: the first manifest's prices.usd_per_hour)",
    )
    s.add_argument("--url-device", default="cpu", help="what a URL target's workers run on (cpu | cuda)")
    s.add_argument(
        "--skip-verify",
        action="store_true",
        default=False,
        help="do not run the `splitserve verify` gate first (recorded in the report)",
    )
    s.add_argument(
        "--verify",
        dest="skip_verify",
        action="store_false",
        help="run `splitserve verify` on each deployment first (the default); a failing one is not run",
    )
    c = p.add_argument_group("client")
    c.add_argument("--model", default=None, help="the model name to request (default: the server's)")
    c.add_argument("--api-key", default=None)
    c.add_argument("--temperature", type=float, default=0.0)
    c.add_argument(
        "--no-ignore-eos",
        dest="ignore_eos",
        action="store_false",
        help="let answers stop at EOS (default: exactly output-len tokens)",
    )
    c.add_argument("--max-concurrency", type=int, default=None)
    c.add_argument(
        "--client-procs",
        type=int,
        default=None,
        metavar="N",
        help="load client processes, each with its share of the requests (default: one per 64 requests "
        "that can be in flight, at most one per core; 1: all in this process)",
    )
    c.add_argument("--timeout-s", type=float, default=600.0, help="per request")
    c.add_argument("--warmup", type=int, default=2, help="unmeasured requests before each target")
    c.add_argument(
        "--interleave",
        action="store_true",
        help="start every target at once and run each rate on all of them back to back (a shared machine's "
        "drifting load then falls on both sides alike; needs room for all deployments at once)",
    )
    o = p.add_argument_group("output")
    o.add_argument("--out", default=None, help="report folder (default bench/results/bench-<time>)")
    o.add_argument("--no-progress", action="store_true")
    return p


def run(args: argparse.Namespace) -> int:
    try:
        targets = _targets(args)
        spec, rates = _workload(args, targets)
        traces = sweep_traces(spec, len(rates))
        slo, prices = _slo_and_prices(args, targets)
    except ValueError as exc:
        print(f"splitserve bench: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"bench/results/bench-{dt.datetime.now():%Y%m%d-%H%M%S}")
    out.mkdir(parents=True, exist_ok=True)
    for i, trace in enumerate(traces):
        write_trace(out / f"trace-{i}.jsonl", at_rate(trace, rates[i], args.burstiness, args.seed))
    opts = RunOptions(
        rates=rates,
        slo=slo,
        prices=prices,
        burstiness=args.burstiness,
        seed=args.seed,
        warmup=args.warmup,
        url_device=args.url_device,
        api_key=args.api_key,
        model=args.model,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        timeout_s=args.timeout_s,
        max_concurrency=args.max_concurrency,
        client_procs=args.client_procs,
        progress=not args.no_progress,
        out_dir=out,
        verify=not args.skip_verify,
    )
    runs = run_targets(targets, traces, opts, interleave=args.interleave)
    report = _report(args, spec, slo, runs)
    return _write(out, report)


def _targets(args: argparse.Namespace) -> list[Target]:
    from splitserve.config.manifest import load_manifest

    overrides = dict(_kv(x, "--set") for x in args.overrides)
    overrides = {k: _scalar(v) for k, v in overrides.items()}
    targets: list[Target] = []
    for raw in args.targets:
        name, sep, src = raw.partition("=")
        if not sep or "/" in name or ":" in name:
            name, src = "", raw
        if src.startswith(("http://", "https://")):
            targets.append(Target(name or src.split("//", 1)[1], src))
            continue
        for mode in args.modes or [None]:
            extra = {**overrides, **({"mode": mode} if mode else {})}
            manifest = load_manifest(src, extra)
            label = name or Path(src).stem
            targets.append(
                Target(f"{label}-{mode}" if args.modes and len(args.modes) > 1 else label, src, manifest)
            )
    names = [t.name for t in targets]
    if len(set(names)) != len(names):
        raise ValueError(f"target names repeat ({', '.join(names)}): name them NAME=TARGET")
    return targets


def _workload(args: argparse.Namespace, targets: list[Target]) -> tuple[WorkloadSpec, list[float | None]]:
    first = next((t.manifest for t in targets if t.manifest is not None), None)
    max_len = args.max_model_len or (first.model.max_model_len if first else None) or 2048
    lo, hi = (int(x) for x in _pair(args.vocab, "--vocab"))
    t_lo, t_hi = (int(x) for x in _pair(args.turns, "--turns"))
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if args.client_procs is not None and args.client_procs < 1:
        raise ValueError("--client-procs must be at least 1")
    spec = WorkloadSpec(
        kind=args.workload,
        num_prompts=args.num_prompts,
        input_len=LengthDist.parse(args.input_len),
        output_len=LengthDist.parse(args.output_len),
        burstiness=args.burstiness,
        seed=args.seed,
        max_model_len=max_len,
        vocab=(lo, hi),
        long_fraction=args.long_fraction,
        system_prompt_len=args.system_prompt_len,
        turns=(t_lo, t_hi),
        think_s=args.think_s,
        trace=args.trace,
    )
    rates: list[float | None] = (
        list(args.request_rates)
        if args.request_rates
        else ([None] if args.workload == "replay" else [0.5, 1.0, 2.0])
    )
    if any(r is not None and not r > 0 for r in rates):
        raise ValueError("request rates must be positive (inf for all at once)")
    return spec, rates


def _slo_and_prices(args: argparse.Namespace, targets: list[Target]) -> tuple[SLO, dict[str, float]]:
    first = next((t.manifest for t in targets if t.manifest is not None), None)
    if first is None:
        from splitserve.config.manifest import Manifest

        first = Manifest()
    slo = SLO(
        ttft_ms=args.slo_ttft_ms or first.slos.ttft_ms,
        tpot_ms=args.slo_tpot_ms or first.slos.itl_ms,
        e2e_ms=args.slo_e2e_ms or first.slos.e2e_ms,
    )
    prices = dict(first.prices.usd_per_hour)
    for item in args.usd_per_hour:
        kind, value = _kv(item, "--usd-per-hour")
        prices[kind] = float(value)
    return slo, prices


def _report(args: argparse.Namespace, spec: WorkloadSpec, slo: SLO, runs: list) -> dict:
    cfg = VerdictConfig(
        margin=args.margin,
        attainment_target=args.attainment_target,
        seed=args.seed,
        max_interference_cores=args.max_interference_cores,
    )
    targets = [r.to_json() for r in runs]
    verdicts = [decide(t, targets[0], cfg).to_json() for t in targets[1:]]
    return {
        "created": dt.datetime.now().isoformat(timespec="seconds"),
        "command": "splitserve bench "
        + shlex.join(sys.argv[2:] if sys.argv[1:2] == ["bench"] else sys.argv[1:]),
        "workload": {"spec": _spec_json(spec), "description": _describe(spec, args)},
        "slo": slo.describe(),
        "config": {
            "slo": slo.__dict__,
            "attainment_target": args.attainment_target,
            "margin": args.margin,
            "seed": args.seed,
            "burstiness": args.burstiness,
            "ignore_eos": args.ignore_eos,
            "temperature": args.temperature,
            "warmup": args.warmup,
            "client_procs": args.client_procs,
            "interleave": args.interleave,
            "max_interference_cores": args.max_interference_cores,
        },
        "code": _code_version(),
        "gate": _gate_summary(args, targets),
        "targets": targets,
        "verdicts": verdicts,
        "rules": rules_text(cfg),
    }


def _code_version() -> str:
    """The git commit this ran from (+ "dirty" with uncommitted changes), where there is one."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=here, capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "-uno"], cwd=here, capture_output=True, text=True
        )
    except OSError:
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + (" (dirty)" if dirty.stdout.strip() else "")


def _gate_summary(args: argparse.Namespace, targets: list[dict]) -> dict:
    if args.skip_verify:
        return GATE_NOT_RUN
    states = {t["name"]: t["gate"]["status"] for t in targets}
    status = "passed" if all(s == "passed" for s in states.values()) else "failed"
    detail = ", ".join(f"{name}: {s}" for name, s in states.items())
    return {"status": status, "detail": f"`splitserve verify` on each deployment before the run: {detail}"}


def _write(out: Path, report: dict) -> int:
    from splitserve.ab import report as rep

    plots = rep.write_plots(out, report)
    rep.write_json(out, report)
    rep.write_html(out, report, plots)
    print()
    print(rep.text_summary(report))
    print(
        f"\nreport: {out / 'report.html'} (json: {out / 'report.json'}; plots: {', '.join(plots) or 'none'})"
    )
    failed = [
        t for t in report["targets"] if t["error"] or not any(p["metrics"]["completed"] for p in t["points"])
    ]
    for t in failed:
        print(
            f"splitserve bench: {t['name']} failed: {t['error'] or 'no request succeeded'}", file=sys.stderr
        )
    return 1 if failed else 0


def _describe(spec: WorkloadSpec, args: argparse.Namespace) -> str:
    rates = ", ".join(
        "as recorded" if r is None else "inf" if math.isinf(r) else f"{r:g}"
        for r in (args.request_rates or [])
    )
    head = f"{spec.kind}, {spec.num_prompts} requests per rate, seed {spec.seed}"
    if spec.kind == "synthetic":
        head += f", prompt {spec.input_len} tokens, output {spec.output_len} tokens"
    elif spec.kind == "replay":
        head = f"replay of {spec.trace}, seed {spec.seed}"
    arrivals = "Poisson" if spec.burstiness == 1 else f"gamma arrivals (burstiness {spec.burstiness:g})"
    return f"{head}; {arrivals}; rates {rates or 'default'} req/s; ignore_eos {args.ignore_eos}"


def _spec_json(spec: WorkloadSpec) -> dict:
    d = dict(spec.__dict__)
    d["input_len"], d["output_len"] = str(spec.input_len), str(spec.output_len)
    return d


def _kv(item: str, flag: str) -> tuple[str, str]:
    key, sep, value = item.partition("=")
    if not sep or not key:
        raise ValueError(f"{flag} wants KEY=VALUE, got {item!r}")
    return key.strip(), value.strip()


def _pair(text: str, flag: str) -> tuple[str, str]:
    a, sep, b = text.partition(":")
    if not sep or not a.isdigit() or not b.isdigit() or int(b) < int(a):
        raise ValueError(f"{flag} wants LO:HI, got {text!r}")
    return a, b


def _scalar(value: str) -> object:
    import yaml

    return yaml.safe_load(value)


__all__ = ["add_parser", "run"]
