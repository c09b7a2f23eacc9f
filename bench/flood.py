"""An unauthenticated flood against an authenticated chat: the chat's latency (48 new tokens, greedy)
alone, then while another process sends ~1,000 unauthenticated chat requests a second for 20 s (each a
401 from the router's gate, router/gate.py); prints both medians and the ratio (goal <= 1.5x), and
what the flood got (statuses, achieved rate). Loopback only; the flood is bounded by --rate x --seconds.

    python bench/flood.py                       # the default model, disaggregated, started here
    python bench/flood.py --rate 1000 --seconds 20 --mode colocated
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

KEY = "sk-flood-bench"
CHAT = {"messages": [{"role": "user", "content": "Tell me about the sea."}], "max_tokens": 48,
        "temperature": 0, "ignore_eos": True}  # fmt: skip


async def _flood_conn(
    host: str, port: int, request: bytes, every_s: float, end: float, got: collections.Counter
):
    reader, writer = await asyncio.open_connection(host, port)
    due = time.monotonic()
    try:
        while (now := time.monotonic()) < end:
            if due > now:
                await asyncio.sleep(due - now)
            due += every_s
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(int(line.split(b":")[1]) for line in head.lower().split(b"\r\n")
                          if line.startswith(b"content-length:"))  # fmt: skip
            await reader.readexactly(length)
            got[status] += 1
    finally:
        writer.close()


def flood(url: str, rate: float, seconds: float, conns: int = 16) -> None:
    """This process as the flood: `rate` unauthenticated chat requests a second over `conns` keep-alive
    connections for `seconds`; prints {status: count} and the achieved rate as one JSON line."""
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "x", **CHAT}).encode()
    request = (f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
               f"Content-Length: {len(body)}\r\n\r\n").encode() + body  # fmt: skip
    got: collections.Counter = collections.Counter()

    async def main() -> None:
        end = time.monotonic() + seconds
        await asyncio.gather(
            *(_flood_conn(host, int(port), request, conns / rate, end, got) for _ in range(conns))
        )

    t0 = time.monotonic()
    asyncio.run(main())
    print(json.dumps({"statuses": dict(got), "per_s": round(sum(got.values()) / (time.monotonic() - t0))}))


def chat_seconds(client, model: str) -> float:
    t0 = time.perf_counter()
    r = client.chat.completions.create(model=model, messages=CHAT["messages"], max_tokens=48, temperature=0,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    assert r.usage.completion_tokens == 48
    return time.perf_counter() - t0


def measure(url: str, model: str, rate: float, seconds: float, repeats: int) -> None:
    import openai

    client = openai.OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=120)
    chat_seconds(client, model)  # warm-up
    alone = [chat_seconds(client, model) for _ in range(repeats)]
    proc = subprocess.Popen([sys.executable, __file__, "--flood", url, "--rate", str(rate),
                             "--seconds", str(seconds)], stdout=subprocess.PIPE, text=True)  # fmt: skip
    time.sleep(1.0)  # the flood at full rate first
    flooded = []
    while proc.poll() is None and len(flooded) < 200:
        flooded.append(chat_seconds(client, model))
    out, _ = proc.communicate(timeout=seconds + 30)
    got = json.loads(out.strip().splitlines()[-1])
    a, f = statistics.median(alone), statistics.median(flooded[:-1] or flooded)
    print(f"flood: {got['per_s']} requests/s for {seconds:g} s, statuses {got['statuses']}")
    print(f"authenticated 48-token chat: alone {a:.3f} s (median of {len(alone)}), under the flood "
          f"{f:.3f} s (median of {len(flooded)}), ratio {f / a:.2f}x (goal <= 1.5x)")  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mode", default="disaggregated")
    ap.add_argument("--model", default=None, help="model.source (default: the embedded default model)")
    ap.add_argument("--rate", type=float, default=1000.0)
    ap.add_argument("--seconds", type=float, default=20.0)
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--flood", metavar="URL", help=argparse.SUPPRESS)  # this process is the flood
    args = ap.parse_args()
    if args.rate * args.seconds > 100_000:
        ap.error("a flood of more than 100,000 requests is refused")
    if args.flood:
        if not args.flood.startswith(("http://127.0.0.1:", "http://localhost:")):
            ap.error("the flood goes to loopback only")
        flood(args.flood, args.rate, args.seconds)
        return 0
    from splitserve.config import load_manifest
    from splitserve.runtime.process import start_serve

    knobs = {"mode": args.mode, "server.port": 0, "server.host": "127.0.0.1", "server.api_keys": [KEY],
             "runtime.standby": False, "runtime.warm_up": False}  # fmt: skip
    if args.model:
        knobs["model.source"] = args.model
    with start_serve(load_manifest(None, knobs), timeout_s=300) as sp:
        measure(sp.url, sp.ready["model"], args.rate, args.seconds, args.repeats)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
