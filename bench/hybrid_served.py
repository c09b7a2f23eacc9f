"""The reference hybrid model (Qwen3.5-9B shape) served, measured at its endpoint.

    python bench/hybrid_served.py --tokenizer TOKDIR                      # random:qwen3.5-9b, both modes
    python bench/hybrid_served.py --model random:qwen3.5-tiny --modes disaggregated --kv-backend tcp \
        --prompt-len 256 --requests 8 --max-tokens 16 --prefix-len 128 --suffix-len 16   # CPU smoke run
    python bench/hybrid_served.py --tokenizer TOKDIR --first-token prefill decode   # both, one run

Per mode (`splitserve serve` started from a manifest; disaggregated: one prefill and one decode worker
on the same device, each with its `engine.memory_utilization` share, KV and state over `--kv-backend`,
once per `--first-token` setting given, `router.first_token`: whether a streamed first token goes as the
prefill worker answers or after the decode worker has fetched the KV; the setting is printed):
1. disaggregated: `splitserve verify` against the running deployment (probe `--probe-mb`, floor
   `--min-gbps`), its table printed;
2. TTFT of one `--prompt-len` prompt, alone, `--ttft-reps` distinct prompts after one warm-up: the
   client's time to the first streamed token and the router's TTFT headers (queue, prefill, transfer);
3. `--requests` such requests at once (`--max-tokens` new tokens each, greedy, `ignore_eos`), driven by
   parallel `curl -N` processes after an untimed pass on other prompts: output tok/s;
4. prefix caching: `--prefix-reqs` requests that share a `--prefix-len`-token system prompt, each with
   its own `--suffix-len`-token tail, one at a time; the first misses, the second records the state
   checkpoint, the rest should hit. Against the TTFT of unique prompts of the same length.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.ab.curl_load import completion_body, run_curl  # noqa: E402

MAX_ID = 30000  # prompt token ids are drawn below this (--max-id)


def prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng, hi = random.Random(seed), MAX_ID
    return [[rng.randint(3, hi) for _ in range(length)] for _ in range(n)]


_CLIENTS: dict = {}


def ttft(url: str, model: str, prompt: list[int], max_tokens: int = 4) -> dict:
    """One streamed request of `max_tokens` tokens: the client's time to the first token, the router's
    headers.
    One keep-alive client for the run, as an application (or the `openai` client) holds one: making an
    httpx client per request costs ~40 ms of SSL-context set-up on the client's side, which an earlier
    version of this bench counted into every TTFT."""
    import httpx

    client = _CLIENTS.get(url) or _CLIENTS.setdefault(url, httpx.Client(timeout=600))
    body = completion_body(model, prompt, max_tokens)
    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        r.raise_for_status()
        pre = "x-splitserve-"
        h = {k.removeprefix(pre): v for k, v in r.headers.items() if k.startswith(pre)}
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"choices":[{' in line.replace(" ", ""):
                first = time.perf_counter() - t0
    return {"client_ms": 1e3 * (first or float("nan")), **h}


def show_ttft(tag: str, rows: list[dict]) -> dict:
    def med(key: str) -> float | None:
        vals = [float(r[key]) for r in rows if r.get(key) is not None]
        return statistics.median(vals) if vals else None

    out = {k: med(k) for k in ("client_ms", "ttft-ms", "ttft-queue-ms", "ttft-prefill-ms",
                               "ttft-transfer-ms", "ttft-first-decode-ms")}  # fmt: skip
    share = (out["ttft-transfer-ms"] or 0) / out["ttft-ms"] if out.get("ttft-ms") else None
    parts = ", ".join(f"{k} {v:.1f}" for k, v in out.items() if v is not None)
    tail = f"; transfer {100 * share:.1f}% of TTFT" if share else ""
    print(f"  {tag}: medians of {len(rows)}: {parts}{tail}")
    print(f"    each (client ms): {[round(r['client_ms'], 1) for r in rows]}")
    return {**out, "transfer_share": share, "each": rows}


def worker_stats(url: str) -> dict:
    import httpx

    from splitserve.wire.auth import worker_headers

    headers = worker_headers(os.environ["SPLITSERVE_KV_SECRET"])
    out = {}
    for w in httpx.get(f"{url}/admin/deployment", timeout=10).json()["workers"]:
        s = httpx.get(f"{w['url']}/stats", headers=headers, timeout=10).json()
        out[w["name"]] = {k: s.get(k) for k in ("prefix_cache", "kv_transfer", "steps", "memory", "kv_cache")}
    return out


def run_mode(args: argparse.Namespace, mode: str, first_token: str | None = None) -> dict:
    import asyncio

    from splitserve.config import load_manifest
    from splitserve.gate.verify import verify_url
    from splitserve.runtime.process import start_serve

    knobs = {
        "mode": mode, "model.source": args.model,
        "model.max_model_len": args.max_model_len
        or max(args.prompt_len, args.prefix_len + args.suffix_len) + args.max_tokens + 64,
        "engine.max_num_seqs": max(args.requests, 8), "engine.max_num_batched_tokens": args.budget,
        "server.port": 0, "server.max_concurrent_requests": 512, "server.max_queued_requests": 512,
        "verify.probe_mb": args.probe_mb, "verify.min_gbps": args.min_gbps, "runtime.cuda_mps": args.cuda_mps,
    }  # fmt: skip
    if args.kv_cache_mb:
        knobs["engine.kv_cache_mb"] = args.kv_cache_mb
    elif args.memory_utilization:
        knobs["engine.memory_utilization"] = args.memory_utilization
    if args.tokenizer:
        knobs["model.tokenizer"] = args.tokenizer
    if args.kv_backend and mode == "disaggregated":
        knobs["transport.backend"] = args.kv_backend
    if args.device:
        knobs["model.device"] = args.device
    if first_token:
        knobs["router.first_token"] = first_token
    manifest = load_manifest(None, knobs)
    setting = f"router.first_token: {manifest.router.first_token}" if mode == "disaggregated" else ""
    res: dict = {"mode": mode, "first_token": manifest.router.first_token if setting else None}
    t0 = time.perf_counter()
    with start_serve(manifest, echo=args.echo, timeout_s=args.start_timeout) as sp:
        url, model = sp.url, sp.ready["model"]
        print(f"== {mode}{f' ({setting})' if setting else ''}: ready in {time.perf_counter() - t0:.1f} s "
              f"({url})", flush=True)  # fmt: skip
        if mode == "disaggregated" and not args.no_verify:
            rep = asyncio.run(verify_url(url, None, os.environ["SPLITSERVE_KV_SECRET"], timeout_s=120))
            print(rep.table(), flush=True)
            res["verify"] = rep.to_dict()
        ttft(url, model, prompts(1, args.prompt_len, 7)[0])  # warm-up (a first prompt of this length)
        rows = [ttft(url, model, p) for p in prompts(args.ttft_reps, args.prompt_len, 11)]
        res["ttft"] = show_ttft(f"TTFT, one {args.prompt_len}-token prompt alone", rows)
        if args.requests:
            warm = prompts(args.requests, args.prompt_len, 21)
            run_curl(url, [completion_body(model, p, args.max_tokens) for p in warm])
            passes = []
            for r in range(args.repeats):
                ps = prompts(args.requests, args.prompt_len, 31 + r)
                run = run_curl(url, [completion_body(model, p, args.max_tokens) for p in ps])
                ttfb = run.pop("ttfb_s")
                print(f"  {args.requests} at once ({args.prompt_len} in, {args.max_tokens} out): "
                      f"{run['tok_s']:,.0f} output tok/s ({run['tokens']} tokens in {run['wall_s']:.2f} s; "
                      f"TTFB median {ttfb[len(ttfb) // 2]:.3f} s, max {ttfb[-1]:.3f} s; clients' CPU "
                      f"{run['client_cpu_s']:.2f} s)", flush=True)  # fmt: skip
                passes.append(run)
            res["load"] = sorted(passes, key=lambda x: x["tok_s"])[(len(passes) - 1) // 2]
            res["load"]["passes_tok_s"] = [round(p["tok_s"], 1) for p in passes]
        if args.prefix_reqs:
            system = prompts(1, args.prefix_len, 41)[0]
            tails = prompts(args.prefix_reqs, args.suffix_len, 43)
            shared = [ttft(url, model, system + t) for t in tails]
            uniq = [ttft(url, model, p) for p in prompts(3, args.prefix_len + args.suffix_len, 47)]
            res["prefix_shared"] = show_ttft("prefix: shared system prompt, in order", shared)
            res["prefix_hits"] = show_ttft("prefix: the 3rd request on (hits)", shared[2:])
            res["prefix_unique"] = show_ttft("prefix: unique prompts of the same length (misses)", uniq)
            hit, miss = res["prefix_hits"]["client_ms"], res["prefix_unique"]["client_ms"]
            if hit and miss:
                print(f"  prefix hit / miss TTFT (client): {hit:.1f} / {miss:.1f} ms = {hit / miss:.2f}x")
        res["workers"] = worker_stats(url)
        for name, s in res["workers"].items():
            print(f"  {name}: prefix_cache {json.dumps(s.get('prefix_cache'))[:300]}")
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="random:qwen3.5-9b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--modes", nargs="+", default=["disaggregated", "colocated"])
    ap.add_argument("--kv-backend", default="cuda_ipc")
    what = "router.first_token, disaggregated: a run per setting (default: the manifest's)"
    ap.add_argument("--first-token", nargs="+", default=[None], choices=("prefill", "decode"), help=what)
    ap.add_argument("--memory-utilization", type=float, default=0.45, help="each worker's device share")
    ap.add_argument("--kv-cache-mb", type=int, default=None, help="instead of --memory-utilization")
    ap.add_argument("--budget", type=int, default=16384, help="engine.max_num_batched_tokens")
    ap.add_argument(
        "--max-model-len", type=int, default=None, help="default: the longest prompt + output + 64"
    )
    ap.add_argument("--cuda-mps", default="auto", choices=("auto", "on", "off"))
    ap.add_argument("--prompt-len", type=int, default=2048)
    ap.add_argument("--ttft-reps", type=int, default=5)
    ap.add_argument("--requests", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--prefix-reqs", type=int, default=6)
    ap.add_argument("--probe-mb", type=float, default=256.0)
    ap.add_argument("--min-gbps", type=float, default=200.0)
    ap.add_argument("--max-id", type=int, default=30000, help="prompt token ids are drawn below this")
    ap.add_argument("--no-verify", action="store_true")
    ap.add_argument("--start-timeout", type=float, default=600.0)
    ap.add_argument("--echo", action="store_true", help="echo the server's log")
    ap.add_argument("--out", default="bench/results/hybrid_served.json")
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_KV_SECRET", os.urandom(16).hex())
    globals()["MAX_ID"] = args.max_id
    results = []
    runs = [(m, ft) for m in args.modes for ft in (args.first_token if m == "disaggregated" else [None])]
    for mode, first_token in runs:
        try:
            results.append(run_mode(args, mode, first_token))
        except Exception as exc:  # noqa: BLE001 - one mode's failure must not lose the other's figures
            print(f"== {mode} FAILED: {type(exc).__name__}: {str(exc)[-3000:]}", flush=True)
            results.append({"mode": mode, "first_token": first_token, "error": repr(exc)[-3000:]})
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_text(json.dumps({"args": vars(args), "results": results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
