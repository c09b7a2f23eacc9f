"""The fault battery: requests in flight against one worker fault each, on a fresh disaggregated deployment
(one prefill and one decode worker, the standby spare on) per fault. Each run sends N streaming greedy
completions (prompts of about 250 tokens, 64-256 new tokens) at once and strikes once they are under
way: kill -9 of the prefill front end, the prefill engine core, the decode front end, the decode engine
core, and a SIGSTOP of the decode engine core (SIGCONT after --stop-s). The first row is the same load
with no fault: its answers are the reference every other run's must equal token for token, and its
latencies the baseline.

    python bench/fault_battery.py                    # every fault (about 2 min per row on 2 CPU cores)
    python bench/fault_battery.py --only "decode core" --requests 12
    python bench/fault_battery.py --on-fault fail    # the same with migration off

Per row: requests lost (ended with an error), hung (not ended within --deadline-s), wrong (an "ok"
answer that differs from the reference), whether every pool was empty afterwards, the migrations the
router counted, and the latency: mean end-to-end, and the added mean and max against the baseline row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serve_harness import MODEL, manifest_yaml, start_deployment  # noqa: E402

FAULTS = {  # name -> (worker, process, signal)
    "no fault": None,
    "kill -9 prefill front end": ("prefill-0", "front end", signal.SIGKILL),
    "kill -9 prefill core": ("prefill-0", "engine core", signal.SIGKILL),
    "kill -9 decode front end": ("decode-0", "front end", signal.SIGKILL),
    "kill -9 decode core": ("decode-0", "engine core", signal.SIGKILL),
    "SIGSTOP decode core": ("decode-0", "engine core", signal.SIGSTOP),
}


@dataclass
class Stream:
    outcome: str = "hung"
    tokens: list[str] = field(default_factory=list)
    seconds: float = 0.0


@dataclass
class Row:
    fault: str
    streams: list[Stream]
    pools_empty: bool
    migrations: float
    wrong: int = 0


def _prompt(i: int) -> str:
    """About 250 tokens, none shared with another prompt's (no prefix-cache hits): 24 of them keep the
    prefill worker busy for seconds, so its faults strike prefills in flight."""
    items = " ".join(f"{i * 1000 + k}," for k in range(60))
    return f"Here is list {i}: {items} Write a long story about list {i}, chapter by chapter:"


def _body(i: int, stream: bool) -> dict:
    return {"model": MODEL, "prompt": _prompt(i),
            "max_tokens": 64 + (i * 37) % 193, "temperature": 0, "ignore_eos": True, "stream": stream,
            "logprobs": 0}  # fmt: skip


async def _one(client: httpx.AsyncClient, url: str, i: int) -> Stream:
    s, t0 = Stream(), time.perf_counter()
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=_body(i, True)) as r:
            if r.status_code != 200:
                s.outcome = f"status {r.status_code}"
                return s
            async for line in r.aiter_lines():
                if line.startswith("data: {"):
                    event = json.loads(line[6:])
                    if "error" in event:
                        s.outcome = f"error {event['error'].get('code')}"
                        return s
                    s.tokens += event["choices"][0]["logprobs"]["tokens"]
        s.outcome = "ok"
    except httpx.HTTPError as exc:
        s.outcome = type(exc).__name__
    finally:
        s.seconds = time.perf_counter() - t0
    return s


def _load(url: str, n: int, strike, deadline_s: float) -> list[Stream]:
    async def main() -> list[Stream]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=10)) as client:
            tasks = [asyncio.create_task(_one(client, url, i)) for i in range(n)]
            await asyncio.to_thread(strike)
            done, pending = await asyncio.wait(tasks, timeout=deadline_s)
            for t in pending:
                t.cancel()
            return [t.result() if t in done else Stream() for t in tasks]

    return asyncio.run(main())


def _busy(dep, role: str, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s["unfinished"] for n, s in dep.worker_stats().items() if n.startswith(role)):
            return
        time.sleep(0.02)


def _migrations(dep) -> float:
    text = httpx.get(f"{dep.url}/metrics", timeout=10).text
    return sum(
        float(v) for v in re.findall(r"^splitserve:request_migrations_total\{[^}]*\} (\S+)$", text, re.M)
    )


def _settled(dep, worker: str | None, restarts: int, timeout_s: float = 120.0) -> bool:
    """Wait for the worker's restart (if any) and a healthy deployment; -> every pool empty."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            h = dep.health()
            back = worker is None or {w["name"]: w for w in h["workers"]}[worker]["restarts"] > restarts
            if h["status"] == "ok" and back:
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    stats = dep.wait_idle(timeout_s=60)
    return all(s["unfinished"] == 0 and s["blocks"]["free"] == s["blocks"]["total"] for s in stats.values())


def run_fault(name: str, args: argparse.Namespace) -> Row:
    fault = FAULTS[name]
    router = {"on_fault": args.on_fault, "timeouts": {"inter_token_s": args.inter_token_s}}
    engine = {"kv_cache_mb": 768}  # room for every request at once on each worker
    manifest = manifest_yaml(mode="disaggregated", router=router, engine=engine, runtime={"standby": True})
    dep = start_deployment(manifest)
    try:
        worker = fault[0] if fault else None
        restarts = {w["name"]: w["restarts"] for w in dep.health()["workers"]}.get(worker or "", 0)
        timers: list[threading.Timer] = []

        def strike() -> None:
            if fault is None:
                return
            victim, process, sig = fault
            w = {x["name"]: x for x in dep.admin()["workers"]}[victim]
            pid = w["pid"] if process == "front end" else w["info"]["core_pid"]
            _busy(dep, victim.split("-")[0])
            if victim.startswith("decode"):
                time.sleep(0.5)  # tokens are streaming
            os.kill(pid, sig)
            if sig == signal.SIGSTOP:
                timers.append(threading.Timer(args.stop_s, os.kill, (pid, signal.SIGCONT)))
                timers[0].start()

        streams = _load(dep.url, args.requests, strike, args.deadline_s)
        for t in timers:
            t.join()
        restarted = fault is not None and fault[2] == signal.SIGKILL
        empty = _settled(dep, worker if restarted else None, restarts)
        return Row(name, streams, empty, _migrations(dep))
    finally:
        dep.stop()


def table(rows: list[Row]) -> str:
    base = rows[0].streams if rows and rows[0].fault == "no fault" else None
    head = ("fault", "lost", "hung", "wrong", "pools empty", "migrations", "mean s", "added mean s",
            "added max s")  # fmt: skip
    out = [head]
    for r in rows:
        errors = [s.outcome for s in r.streams if s.outcome not in ("ok", "hung")]
        lost = f"{len(errors)}" + (f" ({', '.join(sorted(set(errors)))})" if errors else "")
        hung = sum(s.outcome == "hung" for s in r.streams)
        if base is not None:
            r.wrong = sum(
                s.outcome == "ok" and s.tokens != b.tokens for s, b in zip(r.streams, base, strict=True)
            )
        mean = statistics.mean(s.seconds for s in r.streams)
        added = [s.seconds - b.seconds for s, b in zip(r.streams, base, strict=True)] if base else [0.0]
        out.append((r.fault, lost, str(hung), str(r.wrong), "yes" if r.pools_empty else "NO",
                    f"{r.migrations:g}", f"{mean:.2f}", f"{statistics.mean(added):+.2f}",
                    f"{max(added):+.2f}"))  # fmt: skip
    widths = [max(len(row[i]) for row in out) for i in range(len(head))]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in out]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    return "\n".join(lines)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument(
        "--only", default="", help="only faults whose name contains this (the baseline always runs)"
    )
    ap.add_argument("--stop-s", type=float, default=20.0, help="how long the SIGSTOP lasts")
    ap.add_argument("--inter-token-s", type=float, default=30.0, help="router.timeouts.inter_token_s")
    ap.add_argument("--deadline-s", type=float, default=300.0, help="a stream not ended by then is hung")
    ap.add_argument("--on-fault", choices=("migrate", "fail"), default="migrate")
    args = ap.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))  # a deployment under way is stopped
    names = ["no fault", *[n for n in FAULTS if n != "no fault" and args.only in n]]
    rows = []
    for name in names:
        t0 = time.monotonic()
        rows.append(run_fault(name, args))
        print(f"{name}: done in {time.monotonic() - t0:.0f}s", flush=True)
        print(table(rows), flush=True)  # so far
    print()
    print(
        f"{args.requests} streaming greedy completions (250-token prompts, 64-256 new tokens) per row; "
        f"on_fault: {args.on_fault}"
    )
    print(table(rows))
    bad = any(sum(s.outcome != "ok" for s in r.streams) or r.wrong or not r.pools_empty for r in rows)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
