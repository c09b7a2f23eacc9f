"""Cache-aware routing against hash routing and one replica, on real deployments of this host.

    python bench/cache_routing.py                          # the tiny model and the tiny Qwen3.5 hybrid
    python bench/cache_routing.py --models tiny --rounds 3

Per model, three `splitserve serve` deployments (disaggregated, one decode worker), in this order:
  single   one prefill replica                              (the hit rate to reach)
  hash     two prefill replicas, router.policy prefix_affinity (today's hash routing)
  cache    two prefill replicas, router.policy cache_aware
each served the same trace, one request at a time: `--prompts` distinct system prompts of
`--preamble` + `--system` tokens (they share their first `--preamble` tokens, a common preamble, as
system prompts of one application do), asked in turn for `--rounds` rounds, each request with its own
`--suffix`-token question, `--max-tokens` tokens out. Printed per deployment: the prefix-cache hit
rate (hits / lookups, in blocks, from the prefill workers' /stats), the prompt tokens the prefill
workers computed, the requests each replica ran (the router's `x-splitserve-prefill-worker` header)
and the ratio of the largest count to the smallest, the client's TTFT p50, and for cache_aware the
router's estimated against the workers' actual hit tokens. The verdict: a two-replica policy passes
when its hit rate is >= 90% of the single replica's and the request counts are within 1.3x.

The hybrid model is a tiny random-weight Qwen3.5 checkpoint written to a temporary folder (the default
model's tokenizer, positions for 2048 tokens), as tests/router/conftest.py builds it.
"""

from __future__ import annotations

import argparse
import os
import random
import re
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import httpx  # noqa: E402

MAX_ID = 30000  # prompt token ids are drawn below this: inside both models' vocabularies
HIT_GOAL, BALANCE_GOAL = 0.9, 1.3


def trace(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    draw = lambda n: [rng.randint(3, MAX_ID) for _ in range(n)]  # noqa: E731
    preamble = draw(args.preamble)
    systems = [preamble + draw(args.system) for _ in range(args.prompts)]
    return [s + draw(args.suffix) for _ in range(args.rounds) for s in systems]


def hybrid_checkpoint(folder: Path) -> str:
    """A tiny random-weight Qwen3.5 (tests/tiny_configs.py's shape) with the default model's tokenizer."""
    import torch
    from tiny_configs import TINY_QWEN3_5
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from splitserve.model.tokenizer import load_tokenizer

    tok = load_tokenizer(None)
    assert tok is not None
    tok.hf.save_pretrained(str(folder))
    torch.manual_seed(1)
    config = Qwen3_5TextConfig(
        **{**TINY_QWEN3_5, "vocab_size": tok.vocab_size, "max_position_embeddings": 2048}
    )
    Qwen3_5ForCausalLM(config).eval().save_pretrained(folder)
    return str(folder)


def one(client: httpx.Client, url: str, model: str, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    """One streamed request: (the client's time to the first token, the prefill replica that ran it)."""
    from splitserve.ab.curl_load import completion_body

    t0 = time.perf_counter()
    first = None
    with client.stream("POST", f"{url}/v1/completions", json=completion_body(model, prompt, max_tokens)) as r:
        r.raise_for_status()
        worker = r.headers.get("x-splitserve-prefill-worker", "?")
        for line in r.iter_lines():
            if first is None and line.startswith("data: {") and '"text"' in line:
                first = time.perf_counter() - t0
    return first if first is not None else float("nan"), worker


def run_case(
    args: argparse.Namespace, source: str, replicas: int, policy: str, prompts: list[list[int]]
) -> dict:
    from splitserve.config import load_manifest
    from splitserve.runtime.process import start_serve
    from splitserve.wire.auth import worker_headers

    knobs = {
        "mode": "disaggregated", "model.source": source, "model.max_model_len": 2048,
        "prefill.replicas": replicas, "router.policy": policy, "engine.kv_cache_mb": args.kv_cache_mb,
        "runtime.warm_up": False, "runtime.standby": False, "server.port": 0,
    }  # fmt: skip
    with start_serve(load_manifest(None, knobs), timeout_s=600) as sp, httpx.Client(timeout=600) as client:
        url, model = sp.url, sp.ready["model"]
        ttfts, workers = [], Counter()
        for p in prompts:
            t, w = one(client, url, model, p, args.max_tokens)
            ttfts.append(t)
            workers[w] += 1
        time.sleep(0.3)  # the last request's blocks are cached in the step that ends it: let stats see it
        h = worker_headers(os.environ["SPLITSERVE_KV_SECRET"])
        stats = [client.get(f"{w['url']}/stats", headers=h).json() for w in sp.ready["workers"]
                 if w["role"] == "prefill"]  # fmt: skip
        metrics = client.get(f"{url}/metrics").text
    hits = sum(s["prefix_cache"]["hits"] for s in stats)
    queries = sum(s["prefix_cache"]["queries"] for s in stats)
    counts = sorted(workers.values(), reverse=True) + [0] * (replicas - len(workers))
    return {
        "policy": policy if replicas > 1 else "single", "replicas": replicas,
        "hit_rate": hits / queries if queries else 0.0,
        "computed": sum(s["prompt_tokens_computed"] for s in stats),
        "counts": counts, "ratio": counts[0] / counts[-1] if counts[-1] else float("inf"),
        "ttft_p50_ms": 1e3 * statistics.median(ttfts),
        "estimated": _metric_sum(metrics, "splitserve:cache_estimated_hit_tokens_total"),
        "actual": _metric_sum(metrics, "splitserve:cache_actual_hit_tokens_total"),
        "routed": dict(re.findall(_ROUTED, metrics)),
    }  # fmt: skip


_ROUTED = r'splitserve:cache_routed_total\{how="(\w+)"[^}]*\} (\S+)'


def _metric_sum(text: str, name: str) -> float | None:
    vals = [float(v) for v in re.findall(rf"^{re.escape(name)}\{{[^}}]*\}} (\S+)$", text, flags=re.M)]
    return sum(vals) if vals else None


def report(model: str, rows: list[dict]) -> bool:
    single = next(r for r in rows if r["policy"] == "single")
    print(f"\n{model}: {len(rows)} deployments, the same trace")
    print(f"  {'policy':<14} {'hit rate':>8} {'vs single':>9} {'computed':>9} {'requests':>10} {'ratio':>6} "
          f"{'TTFT p50':>9}  verdict")  # fmt: skip
    ok = True
    for r in rows:
        rel = r["hit_rate"] / single["hit_rate"] if single["hit_rate"] else float("nan")
        verdict = ""
        if r["replicas"] > 1:
            good = rel >= HIT_GOAL and r["ratio"] <= BALANCE_GOAL
            verdict = "PASS" if good else "FAIL"
            ok &= good if r["policy"] == "cache_aware" else True
        counts = "/".join(map(str, r["counts"]))
        print(f"  {r['policy']:<14} {r['hit_rate']:>8.3f} {rel:>9.3f} {r['computed']:>9} {counts:>10} "
              f"{r['ratio']:>6.2f} {r['ttft_p50_ms']:>7.1f}ms  {verdict}")  # fmt: skip
        if r["estimated"] is not None:
            print(f"  {'':<14} router estimated {r['estimated']:.0f} hit tokens, workers found "
                  f"{r['actual']:.0f}; picks {r['routed']}")  # fmt: skip
    print(
        f"  goals: hit rate >= {HIT_GOAL:.0%} of the single replica's, request counts within {BALANCE_GOAL}x"
    )
    return ok


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", default="tiny,hybrid", help="tiny (the default model), hybrid (tiny Qwen3.5)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--preamble", type=int, default=256, help="tokens all system prompts share")
    ap.add_argument("--system", type=int, default=256, help="each system prompt's own tokens")
    ap.add_argument("--suffix", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=2)
    ap.add_argument("--kv-cache-mb", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_KV_SECRET", os.urandom(16).hex())
    prompts = trace(args)
    print(f"trace: {args.rounds} rounds of {args.prompts} system prompts ({args.preamble} shared + "
          f"{args.system} own tokens) + {args.suffix}-token questions, {args.max_tokens} tokens out, "
          f"one at a time ({len(prompts)} requests)")  # fmt: skip
    ok = True
    with tempfile.TemporaryDirectory(prefix="cache-routing-") as tmp:
        for name in args.models.split(","):
            source = "default" if name == "tiny" else hybrid_checkpoint(Path(tmp))
            cases = [(1, "least_loaded"), (2, "prefix_affinity"), (2, "cache_aware")]
            rows = [run_case(args, source, n, policy, prompts) for n, policy in cases]
            ok &= report("smollm2-135m (tiny)" if name == "tiny" else "qwen3.5 tiny hybrid", rows)
    print("\nverdict:", "cache_aware meets the goals" if ok else "cache_aware misses a goal")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
