"""Is `splitserve bench`'s load client the bottleneck? The same streamed requests through it and through
parallel `curl -N` processes (a C client), against one running server, with the output tok/s of each.

    python bench/client_check.py http://127.0.0.1:8000 --model random:qwen3-8b
    python bench/client_check.py http://127.0.0.1:8000 --model m --requests 128 --prompt-len 512 \\
        --max-tokens 128 --client-procs 4 --repeats 2

N requests, all sent at once: POST /v1/completions, streamed with `stream_options.include_usage`, a
prompt of seeded random token ids (distinct per request), greedy, `ignore_eos`, a fixed `max_tokens`, so
every request makes exactly max_tokens tokens whichever client sends it. curl: one `curl -sS -N` process
per request (splitserve/ab/curl_load.py: each started first and handed its body at once, so the
clock does not time process creation; its stream written to a file), wall time to the last exit,
tokens from each stream's usage chunk. The bench client:
`run_trace` on the same kind of trace, its duration (the shared start to the last answer), tokens from
usage. Each pass gets fresh prompts (a prefix cache would otherwise favour whichever ran second) unless
--same-prompts; with --repeats the order alternates (curl first, then the bench client first, ...).
A ratio (bench / curl) well under 1 means the client, not the server, set the bench's figure.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.ab import curl_load  # noqa: E402
from splitserve.ab.client import ClientOptions, run_trace  # noqa: E402
from splitserve.ab.workload import BenchRequest  # noqa: E402


def prompts(n: int, length: int, vocab: tuple[int, int], seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(vocab[0], vocab[1]) for _ in range(length)] for _ in range(n)]


def run_curl(url: str, model: str, ps: list[list[int]], max_tokens: int) -> dict:
    """One `curl -N` process per request (splitserve.ab.curl_load), all started first."""
    run = curl_load.run_curl(url, [curl_load.completion_body(model, p, max_tokens) for p in ps])
    run.pop("ttfb_s")
    return {"client": "curl", **run}


def run_bench(url: str, model: str, ps: list[list[int]], max_tokens: int, procs: int | None) -> dict:
    """`splitserve bench`'s client on the same kind of requests, all due at once."""
    trace = [BenchRequest(i, tuple(p), len(p), max_tokens, 0.0) for i, p in enumerate(ps)]
    opts = ClientOptions(model, temperature=0.0, ignore_eos=True, procs=procs)
    stats: dict = {}
    cpu0 = time.process_time()
    results, duration = asyncio.run(run_trace(url, trace, opts, stats=stats))
    cpu = time.process_time() - cpu0 + stats.get("child_cpu_s", 0.0)
    failed = [r for r in results if not r.success]
    if failed:
        r = failed[0]
        raise RuntimeError(f"{len(failed)} bench client requests failed, e.g. {r.error_kind}: {r.error}")
    tokens = sum(r.output_tokens or len(r.itl_s) + 1 for r in results)
    return {"client": "bench", "procs": stats.get("procs", 1), "tokens": tokens, "wall_s": duration,
            "tok_s": tokens / duration, "client_cpu_s": cpu}  # fmt: skip


def check(
    url: str,
    model: str,
    requests: int = 128,
    prompt_len: int = 128,
    max_tokens: int = 128,
    client_procs: int | None = None,
    repeats: int = 1,
    seed: int = 0,
    vocab: tuple[int, int] = (100, 32000),
    same_prompts: bool = False,
    say=print,
) -> dict:
    """Both clients `repeats` times (order alternating); the runs and the ratio of mean tok/s."""
    url = url.rstrip("/")
    runs: list[dict] = []
    k = 0
    for rep in range(repeats):
        order = ("curl", "bench") if rep % 2 == 0 else ("bench", "curl")
        for which in order:
            ps = prompts(requests, prompt_len, vocab, seed if same_prompts else seed + 1009 * k)
            k += 1
            run = run_curl(url, model, ps, max_tokens) if which == "curl" else (
                run_bench(url, model, ps, max_tokens, client_procs))  # fmt: skip
            run["repeat"] = rep
            runs.append(run)
            extra = f", {run['procs']} procs" if which == "bench" else ""
            say(f"  {which:<5} {run['tok_s']:>10,.0f} output tok/s  ({run['tokens']} tokens in "
                f"{run['wall_s']:.2f} s; client CPU {run['client_cpu_s']:.2f} s{extra})")  # fmt: skip
    mean = {c: sum(r["tok_s"] for r in runs if r["client"] == c) / repeats for c in ("curl", "bench")}
    expected = requests * max_tokens
    short = [r for r in runs if r["tokens"] != expected]
    return {"runs": runs, "curl_tok_s": mean["curl"], "bench_tok_s": mean["bench"],
            "ratio": mean["bench"] / mean["curl"], "expected_tokens": expected,
            "short_runs": len(short)}  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="client_check.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    ap.add_argument("--model", required=True, help="the model name to request")
    ap.add_argument("--requests", type=int, default=128, help="N: requests per pass, all at once")
    ap.add_argument("--prompt-len", type=int, default=128, help="prompt tokens per request")
    ap.add_argument("--max-tokens", type=int, default=128, help="output tokens per request (ignore_eos)")
    ap.add_argument(
        "--client-procs", type=int, default=None, help="the bench client's processes (default: auto)"
    )
    ap.add_argument("--repeats", type=int, default=1, help="passes of each client, order alternating")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--vocab", default="100:32000", help="prompt token ids from [LO, HI)")
    ap.add_argument("--same-prompts", action="store_true", help="every pass sends the same prompts")
    ap.add_argument("--out", default=None, help="write the runs as JSON here")
    args = ap.parse_args(argv)
    lo, _, hi = args.vocab.partition(":")
    if args.requests < 1 or args.max_tokens < 1 or args.prompt_len < 1 or args.repeats < 1:
        ap.error("--requests, --prompt-len, --max-tokens and --repeats must be at least 1")
    print(f"{args.requests} x ({args.prompt_len} prompt tokens, {args.max_tokens} out) at {args.url}, "
          f"model {args.model}")  # fmt: skip
    res = check(args.url, args.model, args.requests, args.prompt_len, args.max_tokens, args.client_procs,
                args.repeats, args.seed, (int(lo), int(hi)), args.same_prompts)  # fmt: skip
    print(f"curl {res['curl_tok_s']:,.0f} tok/s, bench client {res['bench_tok_s']:,.0f} tok/s: "
          f"ratio {res['ratio']:.3f} (bench / curl)")  # fmt: skip
    if res["short_runs"]:
        print(f"warning: {res['short_runs']} runs made other than {res['expected_tokens']} tokens")
    if args.out:
        Path(args.out).write_text(json.dumps({"args": vars(args), **res}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
