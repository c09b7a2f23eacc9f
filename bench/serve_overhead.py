"""What the router and HTTP add per token: the same streamed requests through `splitserve serve`
(colocated and disaggregated) and through the engine alone (AsyncLLM in this process), in one run.

    python bench/serve_overhead.py                      # default model, CPU
    python bench/serve_overhead.py --concurrency 1 8 --requests 16 --max-tokens 64

For each concurrency: mean inter-token latency (ITL) and time to first token as the client sees them,
output tokens/s, and the overhead per token over the engine alone (ITL difference) with the ratio.
Greedy, `ignore_eos`, fixed prompts; the engine alone runs with the same torch thread count as a worker.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tqdm.auto import tqdm  # noqa: E402

PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Chapter 1:"


def _summary(runs: list[tuple[float, list[float]]], wall: float) -> dict:
    """runs: (ttft, [gaps]) per request."""
    gaps = [g for _, gs in runs for g in gs]
    tokens = sum(len(gs) + 1 for _, gs in runs)
    return {
        "ttft_ms": 1e3 * statistics.mean(t for t, _ in runs),
        "itl_ms": 1e3 * statistics.mean(gaps) if gaps else float("nan"),
        "itl_p50_ms": 1e3 * statistics.median(gaps) if gaps else float("nan"),
        "out_tok_s": tokens / wall,
        "wall_s": wall,
    }


async def run_engine(llm, prompt_ids: list[int], n: int, conc: int, max_tokens: int, bar) -> dict:  # noqa: ANN001
    from splitserve import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    sem = asyncio.Semaphore(conc)

    async def one(i: int) -> tuple[float, list[float]]:
        async with sem:
            start, last, gaps, ttft, seen = time.perf_counter(), 0.0, [], 0.0, 0
            async for out in llm.generate(prompt_ids, params, f"bench-{conc}-{i}"):
                now = time.perf_counter()
                new = len(out.outputs[0].token_ids) - seen
                seen += new
                if not ttft:
                    ttft, new = now - start, new - 1
                else:
                    gaps += [(now - last) / max(new, 1)] * new
                last = now
            bar.update(1)
            return ttft, gaps

    t0 = time.perf_counter()
    runs = await asyncio.gather(*(one(i) for i in range(n)))
    return _summary(list(runs), time.perf_counter() - t0)


async def run_http(
    url: str, model: str, prompt_ids: list[int], n: int, conc: int, max_tokens: int, bar
) -> dict:  # noqa: ANN001
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=600)
    sem = asyncio.Semaphore(conc)

    async def one(_: int) -> tuple[float, list[float]]:
        async with sem:
            start, last, gaps, ttft = time.perf_counter(), 0.0, [], 0.0
            stream = await client.completions.create(
                model=model,
                prompt=prompt_ids,
                max_tokens=max_tokens,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for chunk in stream:
                if not chunk.choices or not chunk.choices[0].text:
                    continue
                now = time.perf_counter()
                if not ttft:
                    ttft = now - start
                else:
                    gaps.append(now - last)
                last = now
            bar.update(1)
            return ttft, gaps

    t0 = time.perf_counter()
    runs = await asyncio.gather(*(one(i) for i in range(n)))
    await client.close()
    return _summary(list(runs), time.perf_counter() - t0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="default")
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--modes", nargs="+", default=["colocated", "disaggregated"])
    ap.add_argument("--out", default="bench/results/serve_overhead.json")
    args = ap.parse_args()

    import torch

    from splitserve import SamplingParams
    from splitserve.config import load_manifest
    from splitserve.config.engine import EngineConfig
    from splitserve.engine.async_engine import AsyncLLM
    from splitserve.engine.engine import LLMEngine
    from splitserve.runtime.process import start_serve

    torch.set_num_threads(args.threads)
    knobs = {
        "model.source": args.model,
        "model.max_model_len": 2048,
        "engine.kv_cache_mb": 256,
        "engine.threads": args.threads,
        "server.port": 0,
    }
    engine = LLMEngine(
        EngineConfig(
            model=None if args.model == "default" else args.model,
            max_model_len=2048,
            kv_cache_bytes=256 << 20,
            progress=True,
        )
    )
    prompt_ids = engine.tokenizer.encode(PROMPT)
    results: dict = {
        "prompt_tokens": len(prompt_ids),
        "max_tokens": args.max_tokens,
        "requests": args.requests,
        "threads": args.threads,
        "rows": [],
    }
    total = args.requests * len(args.concurrency) * (1 + len(args.modes))
    bar = tqdm(total=total, desc="requests", unit="req")

    async def engine_rows(eng: LLMEngine) -> None:
        llm = AsyncLLM(eng)
        async for _ in llm.generate(prompt_ids, SamplingParams(max_tokens=2), "warm-up"):
            pass
        for conc in args.concurrency:
            row = await run_engine(llm, prompt_ids, args.requests, conc, args.max_tokens, bar)
            results["rows"].append({"path": "engine", "concurrency": conc, **row})
        await llm.shutdown()

    asyncio.run(engine_rows(engine))
    for mode in args.modes:
        manifest = load_manifest(None, {**knobs, "mode": mode})
        with start_serve(manifest) as sp:
            name = sp.ready["model"]

            async def http_rows(url: str = sp.url, model: str = name, mode: str = mode) -> None:
                await run_http(url, model, prompt_ids, 2, 1, 4, tqdm(disable=True))  # warm
                for conc in args.concurrency:
                    row = await run_http(url, model, prompt_ids, args.requests, conc, args.max_tokens, bar)
                    results["rows"].append({"path": mode, "concurrency": conc, **row})

            asyncio.run(http_rows())
    bar.close()

    base = {r["concurrency"]: r for r in results["rows"] if r["path"] == "engine"}
    print(f"\nprompt {len(prompt_ids)} tokens, {args.max_tokens} out, {args.requests} requests, greedy")
    head = f"{'path':<14}{'conc':>5}{'TTFT ms':>10}{'ITL ms':>9}{'tok/s':>9}"
    print(head + f"{'ITL +ms/token':>15}{'tok/s ratio':>13}")
    for r in results["rows"]:
        b = base[r["concurrency"]]
        r["itl_overhead_ms"] = r["itl_ms"] - b["itl_ms"]
        r["throughput_ratio"] = r["out_tok_s"] / b["out_tok_s"]
        print(
            f"{r['path']:<14}{r['concurrency']:>5}{r['ttft_ms']:>10.1f}{r['itl_ms']:>9.2f}{r['out_tok_s']:>9.1f}"
            f"{r['itl_overhead_ms']:>+15.2f}{r['throughput_ratio']:>12.2f}x"
        )
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
