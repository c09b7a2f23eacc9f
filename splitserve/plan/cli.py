"""`splitserve plan`: how many prefill and decode workers a trace needs under its SLOs, from a profile
of this model on this hardware, and the manifest that deploys the answer.

    splitserve plan --devices 2 --request-rate 1 --input-len uniform:128:512 --output-len uniform:32:64
    splitserve plan --profile profile.json --devices 8 --workload rag --request-rate 6 --out plan.yaml
    splitserve plan --profile-only --save-profile profile.json examples/disaggregated.yaml

Without `--profile`, it profiles first (the manifest's model and engine knobs, one worker's threads,
KV over the manifest's transport backend; about half a minute for the default model on a CPU core).
It simulates the trace (the `splitserve bench` workload formats, at one request rate) on colocated
1..N replicas and on every xP:yD with x + y <= N, prints goodput, goodput per device and cost per
accepted response of each, the best with its margin over the runner-up, and writes the manifest that
deploys the best. Exit status: 0, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

import msgspec

from splitserve.ab.metrics import SLO
from splitserve.ab.workload import WORKLOADS, LengthDist, WorkloadSpec, at_rate, build_trace
from splitserve.plan.manifest_out import device_kind, limits_for, plan_manifest, write_manifest
from splitserve.plan.profile import Profile, pooled
from splitserve.plan.search import candidates, choose, evaluate


def add_parser(subparsers: argparse._SubParsersAction) -> argparse.ArgumentParser:
    p = subparsers.add_parser(
        "plan",
        help="size a P:D split from a measured profile: goodput and cost of colocated N vs every xP:yD",
        description=__doc__.split("\n")[0],
    )
    p.add_argument("manifest", nargs="?", default=None, help="the base manifest (model, engine, transport)")
    p.add_argument(
        "--profile",
        nargs="+",
        default=None,
        help="saved profiles (JSON; several: pooled, each coefficient at its median); default: profile now",
    )
    p.add_argument("--save-profile", default=None, metavar="FILE", help="write the profile taken now here")
    p.add_argument("--profile-only", action="store_true", help="profile, print the fit, and stop")
    p.add_argument("--threads", type=int, default=1, help="torch threads of one CPU worker (profiling)")
    p.add_argument(
        "--pin-cores", action="store_true", help="profile as a pinned worker (default: runtime.pin_cores)"
    )
    w = p.add_argument_group("workload (as splitserve bench)")
    w.add_argument("--workload", choices=WORKLOADS, default="synthetic")
    w.add_argument("--num-prompts", type=int, default=200)
    w.add_argument("--input-len", default="uniform:128:512", help="fixed:N | uniform:LO:HI | lognormal:M:S")
    w.add_argument("--output-len", default="uniform:32:64")
    w.add_argument("--request-rate", type=float, default=1.0, help="req/s (inf: all at once)")
    w.add_argument("--burstiness", type=float, default=1.0, help="gamma shape of the gaps (1: Poisson)")
    w.add_argument("--seed", type=int, default=0)
    w.add_argument("--trace", default=None, help="replay: JSONL of {timestamp, prompt_len, output_len}")
    w.add_argument("--long-fraction", type=float, default=0.3)
    w.add_argument("--system-prompt-len", type=int, default=256)
    w.add_argument("--think-s", type=float, default=1.0)
    s = p.add_argument_group("SLOs and cost")
    s.add_argument("--slo-ttft-ms", type=float, default=None, help="default: the manifest's slos.ttft_ms")
    s.add_argument("--slo-tpot-ms", type=float, default=None, help="default: the manifest's slos.itl_ms")
    s.add_argument("--slo-e2e-ms", type=float, default=None)
    s.add_argument(
        "--attainment-target",
        type=float,
        default=0.9,
        help="share of requests that must meet every SLO (0.9: TTFT and TPOT p90 within the SLOs)",
    )
    s.add_argument("--devices", type=int, default=2, help="the device budget N")
    s.add_argument("--price-per-device-hour", type=float, default=None, help="default: the manifest's")
    p.add_argument("--out", default="plan.yaml", help="where to write the chosen deployment's manifest")
    return p


def run(args: argparse.Namespace) -> int:
    from splitserve.config.manifest import load_manifest

    try:
        manifest = load_manifest(args.manifest)
        profile = _profile(args, manifest)
        if args.profile_only:
            return 0
        spec = _spec(args, manifest)
        trace = at_rate(build_trace(spec), args.request_rate, args.burstiness, args.seed)
        slo = SLO(
            ttft_ms=args.slo_ttft_ms or manifest.slos.ttft_ms,
            tpot_ms=args.slo_tpot_ms or manifest.slos.itl_ms,
            e2e_ms=args.slo_e2e_ms or manifest.slos.e2e_ms,
        )
        kind = device_kind(profile.device)
        price = args.price_per_device_hour
        if price is None:
            price = manifest.prices.usd_per_hour.get(kind, math.nan)
        deployments = candidates(
            args.devices, lambda role: limits_for(manifest, role, profile), manifest.router.first_token
        )
    except ValueError as exc:
        print(f"splitserve plan: error: {exc}", file=sys.stderr)
        return 2
    rows = evaluate(trace, deployments, profile.cost, slo, price)
    choice = choose(rows, args.attainment_target)
    print(f"\ntrace: {_describe(spec, args)}; SLOs: {slo.describe()}; ${price:g} per {kind} device-hour\n")
    print(table(rows))
    print("\n" + choice.sentence(args.attainment_target))
    out = plan_manifest(manifest, choice.deployment, profile, slo, price)
    write_manifest(Path(args.out), out, choice, args.attainment_target, _describe(spec, args))
    print(f"manifest: {args.out} (splitserve serve {args.out})")
    return 0


def _profile(args: argparse.Namespace, manifest) -> Profile:  # noqa: ANN001
    if args.profile:
        profile = pooled([Profile.load(path) for path in args.profile])
    else:
        from splitserve.plan.measure import profile_engine
        from splitserve.runtime.common import worker_config

        engine = worker_config(manifest, "colocated", 0, None, "127.0.0.1").engine
        pinned = args.pin_cores or manifest.runtime.pin_cores  # as the manifest's workers will run
        profile = profile_engine(engine, manifest.transport.backend, threads=args.threads, pinned=pinned)
        if pinned:  # the served path on this host's pinned shares: what serving adds to each step
            from splitserve.core.pinning import host_cpus
            from splitserve.plan.served import measure_served

            workers = max(1, len(host_cpus()) // args.threads)
            prefill, decode, request_s = measure_served(manifest, profile.cost, workers)
            profile.cost = msgspec.structs.replace(
                profile.cost, served_factor=prefill, served_decode_factor=decode, request_s=request_s
            )
        if args.save_profile:
            profile.save(args.save_profile)
            print(f"profile saved: {args.save_profile}")
    print(profile.describe())
    return profile


def _spec(args: argparse.Namespace, manifest) -> WorkloadSpec:  # noqa: ANN001
    if args.num_prompts < 1:
        raise ValueError("--num-prompts must be at least 1")
    if not args.request_rate > 0:
        raise ValueError("--request-rate must be positive (inf for all at once)")
    return WorkloadSpec(
        kind=args.workload,
        num_prompts=args.num_prompts,
        input_len=LengthDist.parse(args.input_len),
        output_len=LengthDist.parse(args.output_len),
        burstiness=args.burstiness,
        seed=args.seed,
        max_model_len=manifest.model.max_model_len or 2048,
        long_fraction=args.long_fraction,
        system_prompt_len=args.system_prompt_len,
        think_s=args.think_s,
        trace=args.trace,
    )


def _describe(spec: WorkloadSpec, args: argparse.Namespace) -> str:
    head = f"{spec.kind}, {spec.num_prompts} requests at {args.request_rate:g} req/s, seed {spec.seed}"
    if spec.kind == "synthetic":
        head += f", prompt {spec.input_len}, output {spec.output_len}"
    return head


def table(rows: list) -> str:
    """One line per deployment: goodput, per device, attainment, latency percentiles, cost."""
    head = ("deployment", "dev", "goodput", "/device", "SLO att.", "TTFT p50", "TTFT p90", "TPOT p50",
            "TPOT p90", "$/1k acc.", "busiest")  # fmt: skip
    lines = [head]
    for _, f in rows:
        busiest = max(f.busy.items(), key=lambda kv: kv[1])
        lines.append(
            (
                f.name, str(f.devices), f"{f.goodput_rps:.3f}", f"{f.goodput_per_device:.3f}",
                f"{f.attainment:.0%}", f"{f.ttft_ms['p50']:.0f}", f"{f.ttft_ms['p90']:.0f}",
                f"{f.tpot_ms['p50']:.1f}", f"{f.tpot_ms['p90']:.1f}",
                "inf" if math.isinf(f.usd_per_accepted) else f"{f.usd_per_accepted * 1000:.4f}",
                f"{busiest[0]} {busiest[1]:.0%}",
            )
        )  # fmt: skip
    widths = [max(len(r[i]) for r in lines) for i in range(len(head))]
    text = ["  ".join(_cells(r, widths)) for r in lines]
    return (
        "\n".join(text)
        + "\n(goodput in req/s meeting every SLO; latencies in ms; busiest: its share of the run)"
    )


def _cells(row: tuple[str, ...], widths: list[int]) -> list[str]:
    return [c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True))]


__all__ = ["add_parser", "run", "table"]
