"""What an unauthenticated /metrics flood costs the users: a load's output tokens/s with and without a
flood of scrapes, in one run against one `splitserve serve` (colocated, the default model, an API key set:
/metrics stays open to a scraper, as vLLM's).

    python bench/metrics_flood.py                                # prints figure, baseline, ratio
    python bench/metrics_flood.py --rounds 3 --flood-rps 400 --requests 48

Each round runs the load alone, then the load with the flood (the order alternates between rounds, so
a drift of the machine falls on both sides alike). The load: `--concurrency` clients sending greedy
completions of `--max-tokens` tokens (ignore_eos), `--requests` in all. The flood: another process,
`--flood-conns` keep-alive connections sending GET /metrics without a key as fast as answers come, capped
at `--flood-rps` scrapes/s. Loopback only; every phase is bounded by its requests and `--timeout`.
Goal: flood tok/s >= 0.95 x baseline.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

KEY = "sk-metrics-flood"
PROMPT = "Write a long story about a lighthouse keeper who finds a message in a bottle. Chapter 1:"


async def _scraper(host: str, port: int, until: float, gap_s: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection(host, port)
    request = f"GET /metrics HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode()
    try:
        while time.monotonic() < until:
            t0 = time.monotonic()
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = next(
                int(h.split(b":")[1]) for h in head.lower().split(b"\r\n") if h.startswith(b"content-length")
            )
            await reader.readexactly(length)
            counts[0 if status == 200 else 1] += 1
            await asyncio.sleep(max(0.0, gap_s - (time.monotonic() - t0)))
    finally:
        writer.close()


def _flood(host: str, port: int, seconds: float, conns: int, rps: float, out: mp.Queue) -> None:
    """A separate process: `conns` scrapers for `seconds`; -> (answers 200, other answers)."""

    async def main() -> list[int]:
        counts = [0, 0]
        until = time.monotonic() + seconds
        await asyncio.gather(*(_scraper(host, port, until, conns / rps, counts) for _ in range(conns)))
        return counts

    out.put(asyncio.run(main()))


async def _load(url: str, model: str, requests: int, conc: int, max_tokens: int, timeout: float) -> dict:
    import httpx

    sem, tokens = asyncio.Semaphore(conc), []
    body = {"model": model, "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True}
    headers = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(base_url=url, headers=headers, timeout=timeout) as client:

        async def one() -> None:
            async with sem:
                r = await client.post("/v1/completions", json=body)
                r.raise_for_status()
                tokens.append(r.json()["usage"]["completion_tokens"])

        start = time.perf_counter()
        await asyncio.wait_for(asyncio.gather(*(one() for _ in range(requests))), timeout)
        wall = time.perf_counter() - start
    return {"tok_s": sum(tokens) / wall, "wall_s": wall}


def _phase(args: argparse.Namespace, sp, model: str, flood: bool) -> dict:  # noqa: ANN001
    host, port = sp.url.removeprefix("http://").rsplit(":", 1)
    proc, out = None, mp.Queue()
    if flood:  # the flood runs a little past the load's expected end; the load is what is timed
        proc = mp.Process(target=_flood, args=(host, int(port), args.flood_s, args.flood_conns,
                                               args.flood_rps, out))  # fmt: skip
        proc.start()
        time.sleep(0.5)  # the flood under way before the load starts
    fig = asyncio.run(_load(sp.url, model, args.requests, args.concurrency, args.max_tokens, args.timeout))
    if proc is not None:
        proc.join(args.flood_s + 30)
        ok, other = out.get(timeout=5)
        fig |= {"scrapes": ok, "scrapes_other": other, "scrapes_s": ok / args.flood_s}
    return fig


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--requests", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--flood-conns", type=int, default=8)
    p.add_argument(
        "--flood-rps", type=float, default=200.0, help="cap on scrapes/s, all connections together"
    )
    p.add_argument("--flood-s", type=float, default=0.0, help="flood duration (0: 1.5 x the first baseline)")
    p.add_argument("--timeout", type=float, default=300.0)
    args = p.parse_args()

    from splitserve.config import load_manifest
    from splitserve.runtime.process import start_serve

    knobs = {"mode": "colocated", "server.port": 0, "server.api_keys": [KEY],
             "server.log_stats_interval_s": 0,
             "server.access_log": False}  # fmt: skip
    manifest = load_manifest(None, knobs)
    model = manifest.model.resolved_served_name()
    base, flooded = [], []
    with start_serve(manifest) as sp:
        asyncio.run(_load(sp.url, model, args.concurrency, args.concurrency, 8, args.timeout))  # warm up
        for r in range(args.rounds):
            for flood in (False, True) if r % 2 == 0 else (True, False):
                if flood and not args.flood_s:
                    args.flood_s = 1.5 * (base[0]["wall_s"] if base else 20.0)
                fig = _phase(args, sp, model, flood)
                (flooded if flood else base).append(fig)
                extra = f", {fig['scrapes_s']:.0f} scrapes/s answered" if flood else ""
                print(
                    f"round {r + 1} {'flood' if flood else 'alone'}: {fig['tok_s']:.1f} tok/s{extra}",
                    flush=True,
                )
    baseline = statistics.mean(f["tok_s"] for f in base)
    figure = statistics.mean(f["tok_s"] for f in flooded)
    refused = sum(f["scrapes_other"] for f in flooded)
    print(f"\noutput tok/s under a /metrics flood: {figure:.1f}  baseline (no flood): {baseline:.1f}  "
          f"ratio: {figure / baseline:.3f} (goal >= 0.95)")  # fmt: skip
    rate = statistics.mean(f["scrapes_s"] for f in flooded)
    print(f"flood: {rate:.0f} scrapes/s answered 200 without a key ({args.flood_conns} connections, "
          f"cap {args.flood_rps:g}/s); non-200 answers: {refused}")  # fmt: skip
    return 0 if figure / baseline >= 0.95 and refused == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
