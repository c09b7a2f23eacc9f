"""The host's share of a prefix-cache hit's time to first token: the router's edge in this process, then
the request served, hop figures from the router's TTFT headers.

    python bench/hit_path.py                                # default model, CPU, both modes
    python bench/hit_path.py --modes colocated --hits 20 --max-tokens 1 4

1. The router's edge for a completions body of `--prefix-len` + `--suffix-len` token ids: the JSON parse
   (json_edge.py) and the request's validation (openai_protocol.py), medians of `--reps`; the baseline,
   in the same run, is the parse that checks every value (`parse_json(full=True)`) and the prompt's
   union (`str | list[str] | list[int] | list[list[int]]`) validated as declared.
2. Per mode (`splitserve serve`; disaggregated: `--kv-backend`, `router.first_token: prefill`) and per
   `--max-tokens`: `--hits` streamed requests that share a `--prefix-len`-token prefix, each with its
   own tail, one at a time, after three that fill the cache: the client's TTFT and the router's
   headers (TTFT, queue, prefill, transfer, first-decode: TTFT less the engine's figures), medians.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from hybrid_served import prompts, show_ttft, ttft  # noqa: E402


def _median_us(fn, reps: int) -> float:  # noqa: ANN001
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(times)


def edge(ids: list[int], reps: int) -> dict:
    """The router's parse and validation of one body of `ids`, against the full checks."""
    from pydantic import TypeAdapter

    from splitserve.ab.curl_load import completion_body
    from splitserve.router.json_edge import parse_json
    from splitserve.router.openai_protocol import CompletionRequest

    text = json.dumps(completion_body("m", ids, 4))
    body = parse_json(text)
    union = TypeAdapter(CompletionRequest.model_fields["prompt"].annotation)
    rest = {k: v for k, v in body.items() if k != "prompt"}
    out = {
        "parse_us": _median_us(lambda: parse_json(text), reps),
        "parse_full_us": _median_us(lambda: parse_json(text, full=True), reps),
        "validate_us": _median_us(lambda: CompletionRequest.model_validate(body).prompts(), reps),
        "validate_union_us": _median_us(
            lambda: (union.validate_python(ids), CompletionRequest.model_validate({**rest, "prompt": "x"})),
            reps,
        ),
    }
    now, was = out["parse_us"] + out["validate_us"], out["parse_full_us"] + out["validate_union_us"]
    print(f"router edge, {len(ids)} ids: parse {out['parse_us']:.0f} us (every value checked: "
          f"{out['parse_full_us']:.0f}), validate {out['validate_us']:.0f} us (the union as declared: "
          f"{out['validate_union_us']:.0f}); {now:.0f} vs {was:.0f} us = {was / now:.1f}x",
          flush=True)  # fmt: skip
    return {**out, "ratio": was / now}


def served(args: argparse.Namespace, mode: str) -> dict:
    from splitserve.config import load_manifest
    from splitserve.runtime.process import start_serve

    knobs = {"mode": mode, "model.max_model_len": args.prefix_len + args.suffix_len + 64,
             "engine.kv_cache_mb": args.kv_cache_mb, "engine.max_num_seqs": 8, "server.port": 0,
             "runtime.standby": False, "runtime.warm_up": False}  # fmt: skip
    if mode == "disaggregated":
        knobs["transport.backend"] = args.kv_backend
    res: dict = {"mode": mode}
    with start_serve(load_manifest(None, knobs), timeout_s=args.start_timeout) as sp:
        url, model = sp.url, sp.ready["model"]
        print(f"== {mode} ({url})", flush=True)
        system = prompts(1, args.prefix_len, 41)[0]
        for max_tokens in args.max_tokens:
            tails = prompts(args.hits + 3, args.suffix_len, 43 + max_tokens)
            rows = [ttft(url, model, system + t, max_tokens) for t in tails]
            res[f"max_tokens_{max_tokens}"] = show_ttft(f"max_tokens {max_tokens}, hits", rows[3:])
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--modes", nargs="*", default=["colocated", "disaggregated"])
    ap.add_argument("--kv-backend", default="tcp")
    ap.add_argument("--prefix-len", type=int, default=1024)
    ap.add_argument("--suffix-len", type=int, default=64)
    ap.add_argument("--hits", type=int, default=15)
    ap.add_argument("--max-tokens", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--reps", type=int, default=300)
    ap.add_argument("--kv-cache-mb", type=int, default=256)
    ap.add_argument("--start-timeout", type=float, default=300.0)
    ap.add_argument("--out", default="bench/results/hit_path.json")
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_KV_SECRET", os.urandom(16).hex())
    results: dict = {"edge": edge(prompts(1, args.prefix_len + args.suffix_len, 7)[0], args.reps)}
    for mode in args.modes:
        results[mode] = served(args, mode)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"args": vars(args), **results}, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
