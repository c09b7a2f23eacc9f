"""The endpoint against the engine: the same requests through `splitserve serve` and through
`splitserve.LLM` offline, in one run, with the ratio.

    python bench/serve_gpu.py                                   # CPU: random:tiny, 32 x (128 in, 64 out)
    python bench/serve_gpu.py --model random:qwen3-8b --requests 128 --prompt-len 512 --max-tokens 128
    python bench/serve_gpu.py --requests 1 --max-tokens 256     # batch 1: TPOT against the engine's

Random weights at the model's real shape (no download). Every request is greedy with `ignore_eos`, so
each makes exactly `--max-tokens` tokens; prompts are seeded random token ids, distinct per request.
The offline figure: all requests added at once to an `LLM`, output tokens / wall. Both paths first
run the same workload on other prompts, untimed (kernels compile on first use of a shape).
The endpoint's: `--requests` parallel `curl -N` processes (a C client) posting streamed
/v1/completions at once; output tokens counted from the streams; wall from the first launch to the
last exit (each curl is started beforehand and waits for its body on stdin, so the clock does not
time process creation). The clients' own CPU time is printed beside the wall time so that a
saturated client shows.
`bench/client_check.py` checks `splitserve bench`'s own client against curl on a running server.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.ab.curl_load import completion_body, run_curl  # noqa: E402


def _prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    hi = min(vocab, 32000) - 1
    return [[rng.randint(3, hi) for _ in range(length)] for _ in range(n)]


def offline(
    model: str,
    sets: list[list[list[int]]],
    warm: list[list[int]],
    max_tokens: int,
    knobs: dict,
    warmups: int = 1,
) -> dict:
    """All requests of a set added at once to an LLMEngine (as LLM.generate does), stepped to the end;
    each request's TPOT from the times of the steps that gave its first and last tokens; one timed pass
    per set, -> the median pass (by tok/s) with every pass's tok/s. `warm`: the same workload with other
    prompts, run first untimed (kernels compile on their first shapes; other prompts, so that the
    prefix cache does not skip a timed pass's prefill)."""
    import torch

    from splitserve import LLM, SamplingParams

    llm = LLM(model, progress=False, **knobs)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for _ in range(warmups):
        llm.generate(warm, params, use_tqdm=False)
    passes = [_offline_pass(llm.engine, prompts, params) for prompts in sets]
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return _median(passes)


def _offline_pass(engine, prompts: list[list[int]], params) -> dict:  # noqa: ANN001
    import torch

    if engine.device.type == "cuda":
        torch.cuda.synchronize()
    steps0 = (engine.forward_steps, engine.overlapped_steps, engine.step_seconds)
    t0 = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"bench-{t0}-{i}")
    first: dict[str, float] = {}
    tpots, tokens = [], 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            first.setdefault(out.request_id, now)
            if out.finished:
                n = len(out.outputs[0].token_ids)
                tokens += n
                if n > 1:
                    tpots.append((now - first[out.request_id]) / (n - 1))
    wall = time.perf_counter() - t0
    fwd, ovl, in_step = (engine.forward_steps - steps0[0], engine.overlapped_steps - steps0[1],
                         engine.step_seconds - steps0[2])  # fmt: skip
    print(f"  engine offline: {tokens / wall:,.0f} tok/s; {fwd} steps ({ovl} overlapped); "
          f"{in_step:.3f} s in step() of {wall:.3f} s")  # fmt: skip
    tpot = 1e3 * sum(tpots) / len(tpots) if tpots else None
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "tpot_ms": tpot}


def _median(passes: list[dict]) -> dict:
    """The median pass by tok/s (the lower middle one of an even count), with every pass's tok/s."""
    ranked = sorted(passes, key=lambda r: r["tok_s"])
    return {**ranked[(len(ranked) - 1) // 2], "passes_tok_s": [round(r["tok_s"], 1) for r in passes]}


def endpoint_tpot(url: str, model: str, prompt: list[int], max_tokens: int) -> float:
    """One streamed request (a Python client keeps up with one stream): TPOT in ms, first chunk with
    text to the last, per token (usage gives the count)."""
    import httpx

    body = completion_body(model, prompt, max_tokens)
    times, tokens = [], 0
    with httpx.stream("POST", f"{url}/v1/completions", json=body, timeout=600) as r:
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
            if chunk.get("choices"):
                times.append(time.perf_counter())
    return 1e3 * (times[-1] - times[0]) / max(1, tokens - 1)


def endpoint_curl(
    url: str, model: str, prompts: list[list[int]], max_tokens: int, timed: bool = True
) -> dict:
    before = worker_steps(url) if timed else {}
    run = run_curl(url, [completion_body(model, p, max_tokens) for p in prompts])
    ttfb = run.pop("ttfb_s")
    mid = ttfb[len(ttfb) // 2]
    tag = "" if timed else " (warm-up)"
    print(f"  time to first byte{tag}: min {ttfb[0]:.3f} s, median {mid:.3f} s, max {ttfb[-1]:.3f} s")
    if timed:
        after = worker_steps(url)
        for name, now in after.items():
            was = before.get(name, {})
            d = {k: v - was.get(k, 0) for k, v in now.items()}
            print(
                f"  {name}: {d.get('forward', 0)} steps ({d.get('overlapped', 0)} overlapped); "
                f"{d.get('step_s', 0):.3f} s in step() of {d.get('loop_s', 0):.3f} s of busy loop turns"
            )
    return run


def worker_steps(url: str) -> dict[str, dict[str, float]]:
    """Each worker's engine step counters (its /stats), through the deployment's worker token."""
    import httpx

    from splitserve.wire.auth import worker_headers

    headers = worker_headers(os.environ["SPLITSERVE_KV_SECRET"])
    out = {}
    for w in httpx.get(f"{url}/admin/deployment", timeout=10).json()["workers"]:
        steps = httpx.get(f"{w['url']}/stats", headers=headers, timeout=10).json().get("steps") or {}
        out[w["name"]] = steps
    return out


def endpoint(
    args: argparse.Namespace,
    mode: str,
    sets: list[list[list[int]]],
    warm: list[list[int]],
    manifest_knobs: dict,
) -> dict:
    from splitserve.config import load_manifest
    from splitserve.runtime.process import start_serve

    knobs = {**manifest_knobs, "mode": mode}
    if mode == "disaggregated" and args.cuda_mps:  # `on` refuses a deployment with no shared GPU
        knobs["runtime.cuda_mps"] = args.cuda_mps
    manifest = load_manifest(args.manifest, knobs)
    with start_serve(manifest, echo=args.echo) as sp:
        model = sp.ready["model"]
        for _ in range(args.warmups):
            endpoint_curl(sp.url, model, warm, args.max_tokens, timed=False)  # warm-up, as the engine's
        runs = []
        if len(sets[0]) == 1:
            endpoint_tpot(sp.url, model, sets[0][0], 8)  # warm-up
            tpot = endpoint_tpot(sp.url, model, sets[0][0], args.max_tokens)
            runs.append({"client": "python", "tpot_ms": tpot})
        for client in args.client:
            passes = [endpoint_curl(sp.url, model, prompts, args.max_tokens) for prompts in sets]
            runs.append({"client": client, **_median(passes)})
        if args.top:
            os.system("top -b -n 1 | head -20")  # noqa: S605 - a look at who is busy, on request
        return {"mode": mode, "runs": runs}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=None, help="default: random:tiny on CPU, random:qwen3-8b on CUDA")
    ap.add_argument("--manifest", default=None, help="a manifest to start from (its model is replaced)")
    ap.add_argument("--requests", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--modes", nargs="+", default=["colocated", "disaggregated"])
    ap.add_argument("--client", nargs="+", default=["curl"], choices=("curl",))
    ap.add_argument("--kv-backend", default=None, help="disaggregated: tcp | shm | cuda_ipc | nccl")
    ap.add_argument("--cuda-mps", default=None, choices=("auto", "on", "off"),
                    help="runtime.cuda_mps of the disaggregated run (default: the manifest's)")  # fmt: skip
    ap.add_argument("--max-num-seqs", type=int, default=None)
    ap.add_argument("--max-num-batched-tokens", type=int, default=None)
    ap.add_argument("--tokenizer", default=None, help="an HF tokenizer directory (default: the model's)")
    ap.add_argument("--kv-cache-mb", type=int, default=None,
                    help="KV budget of every engine (default: 1024 on CPU, 16384 on CUDA, so that two "
                         "workers share one GPU)")  # fmt: skip
    ap.add_argument("--threads", type=int, default=None, help="CPU: torch threads (default: all cores)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--warmups", type=int, default=1, help="untimed passes of the workload first, each path")
    ap.add_argument("--repeats", type=int, default=1,
                    help="timed passes, each on its own prompts (the same sets for both paths); the median "
                         "pass of each path is compared")  # fmt: skip
    ap.add_argument("--stream-interval", type=int, default=None,
                    help="server.stream_interval: tokens a chunk holds at least (default 1)")  # fmt: skip
    ap.add_argument("--top", action="store_true", help="print `top` after each endpoint run")
    ap.add_argument("--echo", action="store_true", help="echo the server's log")
    ap.add_argument("--out", default="bench/results/serve_gpu.json")
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_KV_SECRET", os.urandom(16).hex())  # the deployment's (worker /stats)

    import torch

    cuda = torch.cuda.is_available()
    model = args.model or ("random:qwen3-8b" if cuda else "random:tiny")
    threads = args.threads or (1 if cuda else os.cpu_count() or 1)
    torch.set_num_threads(threads)
    max_len = args.prompt_len + args.max_tokens + 16
    seqs = args.max_num_seqs or max(args.requests, 1)
    budget = args.max_num_batched_tokens or max(2048, seqs)
    engine_knobs = {"max_model_len": max_len, "max_num_seqs": seqs, "max_num_batched_tokens": budget}
    kv_mb = args.kv_cache_mb or (16384 if cuda else 1024)
    engine_knobs["kv_cache_bytes"] = kv_mb << 20
    if args.tokenizer:
        engine_knobs["tokenizer"] = args.tokenizer
    vocab = 512 if "tiny" in model else 32000
    # timed passes: set 0 from --seed, the others from seeds far from the warm-up's (seed + 1)
    sets = [
        _prompts(args.requests, args.prompt_len, vocab, args.seed + (1000 * r)) for r in range(args.repeats)
    ]
    warm = _prompts(args.requests, args.prompt_len, vocab, args.seed + 1)
    print(f"model {model} on {'cuda' if cuda else 'cpu'} ({threads} threads); {args.requests} requests of "
          f"{args.prompt_len} prompt tokens, {args.max_tokens} new tokens, greedy, ignore_eos")  # fmt: skip
    base = offline(model, sets, warm, args.max_tokens, engine_knobs, args.warmups)
    print(f"engine offline: {base['tok_s']:,.0f} output tok/s ({base['tokens']} tokens in "
          f"{base['wall_s']:.2f} s), mean TPOT {base['tpot_ms'] or 0:.2f} ms; median of passes "
          f"{base['passes_tok_s']}")  # fmt: skip
    knobs = {
        "model.source": model, "model.max_model_len": max_len, "engine.max_num_seqs": seqs,
        "engine.max_num_batched_tokens": budget, "engine.threads": threads, "server.port": 0,
        "server.max_concurrent_requests": max(256, 2 * args.requests),
        "server.max_queued_requests": max(256, 2 * args.requests),
    }  # fmt: skip
    knobs["engine.kv_cache_mb"] = kv_mb
    if args.tokenizer:
        knobs["model.tokenizer"] = args.tokenizer
    if args.kv_backend:
        knobs["transport.backend"] = args.kv_backend
    if args.stream_interval:
        knobs["server.stream_interval"] = args.stream_interval
    rows = []
    for mode in args.modes:
        res = endpoint(args, mode, sets, warm, knobs)
        for run in res["runs"]:
            if "tpot_ms" in run:
                ratio = run["tpot_ms"] / base["tpot_ms"]
                rows.append({"mode": mode, **run, "ratio": ratio})
                tp = run["tpot_ms"]
                print(f"{mode:<14} {run['client']:<6} TPOT {tp:.2f} ms  {ratio:5.3f}x the engine's")
                continue
            ratio = run["tok_s"] / base["tok_s"]
            rows.append({"mode": mode, **run, "ratio": ratio})
            print(f"{mode:<14} {run['client']:<6} {run['tok_s']:>10,.0f} output tok/s  {ratio:5.2f}x engine  "
                  f"({run['tokens']} tokens in {run['wall_s']:.2f} s; clients' CPU "
                  f"{run['client_cpu_s']:.2f} s; median of passes {run['passes_tok_s']})")  # fmt: skip
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"model": model, "engine": base, "rows": rows, "args": vars(args)}, indent=1))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
