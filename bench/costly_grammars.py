"""Costly grammars beside bystanders, served: two plain streaming chats run while, in turn, a trivially
refused request (an empty guided_choice: the baseline) and the four hostile grammars (a 100,000-value
enum, a 100,000-entry guided_choice, `^(a+)+$`, `^a{1000000}$`) are sent; prints each refusal's status
and latency and the bystanders' median latency beside each, with the ratio (goal <= 1.5x).

    python bench/costly_grammars.py                # random:tiny-chat, disaggregated, started here
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

MESSAGES = [{"role": "user", "content": "Give me the answer."}]
HOSTILE = {
    "enum 100k": {"guided_json": {"enum": [f"v{i}" for i in range(100_000)]}},
    "choice 100k": {"guided_choice": [f"c{i}" for i in range(100_000)]},
    "^(a+)+$": {"guided_regex": "^(a+)+$"},
    "^a{1000000}$": {"guided_regex": "^a{1000000}$"},
}
TRIVIAL = {"guided_choice": []}


async def bystander(client, model: str, tokens: int) -> float:
    t0 = time.perf_counter()
    stream = await client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=tokens,
                                                  stream=True, extra_body={"ignore_eos": True})  # fmt: skip
    async for _ in stream:
        pass
    return time.perf_counter() - t0


async def refused(http, model: str, extra: dict) -> tuple[int, float]:
    """One request whose body is encoded before the clock starts (the bystanders share this process:
    encoding a megabyte of JSON here would stall them, and that is not the server's cost)."""
    body = json.dumps({"model": model, "messages": MESSAGES, "max_tokens": 8, **extra}).encode()
    t0 = time.perf_counter()
    r = await http.post("/v1/chat/completions", content=body, headers={"content-type": "application/json"})
    return r.status_code, time.perf_counter() - t0


async def beside(client, http, model: str, extras: list[dict], tokens: int) -> tuple[list[float], list]:
    """Two bystanders started, then `extras` sent at once; -> (bystander seconds, (status, seconds))."""
    by = [asyncio.create_task(bystander(client, model, tokens)) for _ in range(2)]
    await asyncio.sleep(0.05)  # the bystanders are in the engine first
    answers = await asyncio.gather(*(refused(http, model, e) for e in extras))
    return list(await asyncio.gather(*by)), answers


async def measure(url: str, model: str, rounds: int, tokens: int) -> None:
    import httpx
    import openai

    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    http = httpx.AsyncClient(base_url=url, timeout=120)
    await beside(client, http, model, [TRIVIAL], tokens)  # warm-up
    base, hostile, answers = [], [], []
    for _ in range(rounds):  # interleaved: drift in the machine's load touches both alike
        b, _ = await beside(client, http, model, [TRIVIAL], tokens)
        base += b
        h, a = await beside(client, http, model, list(HOSTILE.values()), tokens)
        hostile += h
        answers.append(a)
    for i, name in enumerate(HOSTILE):
        statuses = sorted({a[i][0] for a in answers})
        worst = max(a[i][1] for a in answers)
        print(f"{name:>14}: status {statuses}, slowest answer {worst * 1e3:.0f} ms")
    mb, mh = statistics.median(base), statistics.median(hostile)
    print(f"bystanders ({tokens} tokens, {len(base)} each): beside a trivial refusal {mb:.3f} s, "
          f"beside the hostile grammars {mh:.3f} s, ratio {mh / mb:.2f}x (goal <= 1.5x)")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:tiny-chat")
    ap.add_argument("--mode", default="disaggregated")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--tokens", type=int, default=64)
    args = ap.parse_args()
    from splitserve.config import load_manifest
    from splitserve.runtime.process import start_serve

    knobs = {"mode": args.mode, "model.source": args.model, "model.max_model_len": 512, "server.port": 0,
             "engine.kv_cache_mb": 32, "runtime.standby": False, "runtime.warm_up": False}  # fmt: skip
    with start_serve(load_manifest(None, knobs), timeout_s=300) as sp:
        asyncio.run(measure(sp.url, sp.ready["model"], args.rounds, args.tokens))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
