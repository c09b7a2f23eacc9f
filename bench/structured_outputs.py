"""The cost of constrained decoding: output tok/s with and without a JSON schema on the same trace.

Trace: `--batch` requests (seeded random prompt token ids of `--prompt-len`), all handed to the engine at
once, each decoding exactly `--max-tokens` tokens (greedy, ignore_eos). Constrained, every request
carries the same nested JSON schema (an array of at least 1,000 objects with bounded integers, short
strings and enums), which no request can finish within `--max-tokens`: both runs decode the same number
of tokens, and the difference is the grammar's (the bitmask filled per row on the host, copied and
applied on the device, the matcher advanced per token, and no overlapped steps). The grammar is compiled
once before the timed runs (its compile time is printed apart); the two runs alternate `--repeats`
times and the medians are compared. The goal: >= 0.9x at batch 32.

    python bench/structured_outputs.py                                   # CPU: random:tiny-chat
    python bench/structured_outputs.py --model random:qwen3-8b --device cuda --batch 32 --max-tokens 256
    python bench/structured_outputs.py --endpoint http://127.0.0.1:8000 --model random:tiny-chat   # served
    python bench/structured_outputs.py --model random:qwen3-8b --device cuda --serve   # served, started here

With `--endpoint`, the same trace goes through a running server's /v1/completions (token-id prompts)
instead: with and without `structured_outputs.json`, so the figure includes the router and the workers.
`--serve` starts `splitserve serve` itself (colocated, the same model, tokenizer and device) and runs the
trace at its endpoint.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

SCHEMA = {
    "type": "object",
    "properties": {
        "rows": {
            "type": "array",
            "minItems": 1000,
            "items": {
                "type": "object",
                "properties": {
                    "id": {"type": "integer", "minimum": 0, "maximum": 99999},
                    "name": {"type": "string", "maxLength": 8},
                    "kind": {"enum": ["alpha", "beta", "gamma"]},
                    "ok": {"type": "boolean"},
                },
                "required": ["id", "name", "kind", "ok"],
            },
        }
    },
    "required": ["rows"],
}


def trace(args: argparse.Namespace, vocab: int) -> list[list[int]]:
    rng = random.Random(args.seed)
    return [
        [rng.randrange(100, min(vocab, 40000)) for _ in range(args.prompt_len)] for _ in range(args.batch)
    ]


def engine_run(args: argparse.Namespace) -> tuple[float, float, float]:
    """-> (unconstrained tok/s, constrained tok/s, compile seconds), in process."""
    from splitserve.engine.llm import LLM
    from splitserve.sampling.params import GrammarSpec, SamplingParams

    llm = LLM(
        model=args.model,
        device=args.device,
        max_model_len=args.prompt_len + args.max_tokens + 16,
        max_num_seqs=max(args.batch, 1),
        progress=False,
        **_kv(args),
        **({"tokenizer": args.tokenizer} if args.tokenizer else {}),
        **({"async_scheduling": False} if args.no_async else {}),
    )
    prompts = [{"prompt_token_ids": p} for p in trace(args, llm.engine.model_config.vocab_size)]
    spec = GrammarSpec("json", json.dumps(SCHEMA))
    t0 = time.perf_counter()
    llm.engine.grammars.compile(spec).result()
    compile_s = time.perf_counter() - t0
    plain = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True)
    constrained = SamplingParams(temperature=0, max_tokens=args.max_tokens, ignore_eos=True, grammar=spec)
    llm.generate(prompts[:2], SamplingParams(temperature=0, max_tokens=8), use_tqdm=False)  # warm up
    rates: dict[int, list[float]] = {0: [], 1: []}
    for _ in range(args.repeats):  # alternated, so that a noisy neighbour hits both alike
        for which, params in enumerate((plain, constrained)):
            t0 = time.perf_counter()
            outs = llm.generate(prompts, params, use_tqdm=False)
            seconds = time.perf_counter() - t0
            tokens = sum(len(o.outputs[0].token_ids) for o in outs)
            assert tokens == args.batch * args.max_tokens, (tokens, "every request must decode max_tokens")
            rates[which].append(tokens / seconds)
    return statistics.median(rates[0]), statistics.median(rates[1]), compile_s


def _kv(args: argparse.Namespace) -> dict:
    return {"kv_cache_bytes": args.kv_cache_mb << 20} if args.kv_cache_mb else {}


async def endpoint_run(args: argparse.Namespace) -> tuple[float, float, float]:
    """-> (unconstrained tok/s, constrained tok/s, first constrained request's seconds), served."""
    import httpx

    prompts = trace(args, 49152)
    async with httpx.AsyncClient(base_url=args.endpoint, timeout=600) as client:

        async def one(prompt: list[int], extra: dict) -> int:
            body = {
                "model": args.model,
                "prompt": prompt,
                "max_tokens": args.max_tokens,
                "temperature": 0,
                "ignore_eos": True,
                **extra,
            }
            r = await client.post("/v1/completions", json=body)
            r.raise_for_status()
            return r.json()["usage"]["completion_tokens"]

        constrained = {"structured_outputs": {"json": SCHEMA}}
        t0 = time.perf_counter()
        await one(prompts[0], constrained)  # compiles the grammar on the workers
        first_s = time.perf_counter() - t0
        rates: dict[int, list[float]] = {0: [], 1: []}
        for _ in range(args.repeats):
            for which, extra in enumerate(({}, constrained)):
                t0 = time.perf_counter()
                tokens = sum(await asyncio.gather(*(one(p, extra) for p in prompts)))
                rates[which].append(tokens / (time.perf_counter() - t0))
    return statistics.median(rates[0]), statistics.median(rates[1]), first_s


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:tiny-chat")
    ap.add_argument("--device", default="auto")
    ap.add_argument("--no-async", action="store_true",
                    help="no overlapped steps in either run (what constrained ones lose)")  # fmt: skip
    ap.add_argument("--tokenizer", default=None, help="an HF tokenizer directory (default: the model's)")
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--kv-cache-mb", type=int, default=0, help="0: the engine's default budget")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--repeats", type=int, default=3, help="runs of each, alternated; medians printed")
    ap.add_argument("--endpoint", default=None, help="a running server's URL (no /v1)")
    ap.add_argument("--serve", action="store_true", help="serve here (colocated), then the trace")
    args = ap.parse_args()
    if args.serve:  # the same trace through a server started here
        from splitserve.runtime.process import start_serve

        cli = [args.model, "--mode", "colocated", "--port", "0", "--max-num-seqs", str(max(args.batch, 8)),
               "--max-model-len", str(args.prompt_len + args.max_tokens + 16)]  # fmt: skip
        cli += ["--device", args.device] if args.device != "auto" else []
        cli += ["--tokenizer", args.tokenizer] if args.tokenizer else []
        with start_serve(None, timeout_s=600, args=cli) as sp:
            args.endpoint = sp.url
            plain, constrained, setup_s = asyncio.run(endpoint_run(args))
        where = f"endpoint, colocated `splitserve serve` at {args.endpoint}"
    elif args.endpoint:
        plain, constrained, setup_s = asyncio.run(endpoint_run(args))
        where = f"endpoint {args.endpoint}"
    else:
        plain, constrained, setup_s = engine_run(args)
        where, setup = f"engine, device {args.device}", f"grammar compile {setup_s * 1000:.1f} ms"
    if args.endpoint:
        setup = f"first constrained request {setup_s * 1000:.0f} ms"
    print(
        f"{args.model} ({where}): batch {args.batch}, prompt {args.prompt_len}, {args.max_tokens} output "
        f"tokens each; {setup}"
    )
    print(f"unconstrained: {plain:10.1f} output tok/s (median of {args.repeats})")
    print(f"json_schema:   {constrained:10.1f} output tok/s (median of {args.repeats})")
    ratio = constrained / plain
    print(f"ratio: {ratio:.3f}x (goal >= 0.9x at batch 32): {'met' if ratio >= 0.9 else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
