"""The chaos suite's harness: a deployment under streaming load, the checks every case ends with, and
the summary table. The deployment helpers are the serving tests' own (tests/serve_harness.py,
tests/router/test_resilience.py), loaded by path: this folder has no conftest of its own, so that
`bench/chaos.py` can use the same code outside pytest.

Checks (`Context.check_after`): 0 hung (every client ended before its deadline), 0 wrong (a finished
stream equals the greedy reference taken on the fresh deployment before any fault; a cut-off one is a
prefix of it), the pools full again, no temp folder left by a dead process of the deployment, and
no decode core still mapping a dead prefill's KV.
"""

from __future__ import annotations

import asyncio
import importlib.util
import json
import os
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import httpx

TESTS = Path(__file__).resolve().parents[1]


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


# under its own name, which the serving tests import it by (test_resilience: `from serve_harness import`)
serve = sys.modules.get("serve_harness") or _load("serve_harness", TESTS / "serve_harness.py")
resilience = _load("chaos_serve_resilience", TESTS / "router" / "test_resilience.py")

MODEL: str = serve.MODEL
PROMPTS = [f"Count from {i} to {i + 40}, one number a line:" for i in range(6)]
MAX_TOKENS = 32


@dataclass
class Stream:
    text: str = ""
    outcome: str = "hung"  # ok | error: ... | hung
    ended: float = 0.0


@dataclass
class Result:
    case: str
    expected: str
    outcome: str
    passed: bool
    seconds: float = 0.0


async def _stream(client: httpx.AsyncClient, url: str, prompt: str, max_tokens: int) -> Stream:
    s = Stream()
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}  # fmt: skip
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
            if r.status_code != 200:
                s.outcome = f"error: {r.status_code}"
                return s
            async for line in r.aiter_lines():
                if not line.startswith("data: {"):
                    continue
                event = json.loads(line[6:])
                if "error" in event:
                    s.outcome = f"error: {event['error'].get('code') or event['error'].get('type')}"
                    return s
                s.text += event["choices"][0]["text"]
        s.outcome = "ok"
    except httpx.HTTPError as exc:
        s.outcome = f"error: {type(exc).__name__}"
    finally:
        s.ended = time.monotonic()
    return s


def under_load(url: str, fault: Any, n: int = len(PROMPTS), deadline_s: float = 120.0) -> list[Stream]:
    """`n` greedy streams; `fault()` runs in a thread once they are under way; -> each stream, "hung"
    where it had not ended `deadline_s` after the start."""

    async def main() -> list[Stream]:
        async with httpx.AsyncClient(timeout=httpx.Timeout(deadline_s, connect=10)) as client:
            tasks = [asyncio.create_task(_stream(client, url, PROMPTS[i % len(PROMPTS)], MAX_TOKENS))
                     for i in range(n)]  # fmt: skip
            await asyncio.to_thread(fault)
            done, pending = await asyncio.wait(tasks, timeout=deadline_s)
            for t in pending:
                t.cancel()
            return [t.result() if t in done else Stream() for t in tasks]

    return asyncio.run(main())


def reference(url: str, headers: dict | None = None) -> list[str]:
    """The greedy answers, one request at a time, on a deployment no fault has touched yet."""
    out = []
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                "ignore_eos": True}  # fmt: skip
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers or {}, timeout=120)
        r.raise_for_status()
        out.append(r.json()["choices"][0]["text"])
    return out


def temp_leftovers(pids: set[int], extra: tuple[str, ...] = ()) -> list[str]:
    """/tmp/splitserve-* folders still named by one of `pids` (none of them alive), and `extra` paths."""
    root = tempfile.gettempdir()
    tags = {f"-{p}-" for p in pids}
    left = [n for n in os.listdir(root) if n.startswith("splitserve-") and any(t in n for t in tags)]
    return left + [p for p in extra if os.path.exists(p)]


def memfd_inodes(pid: int) -> set[str]:
    """The KV memfds (shm direct mode) that process `pid` maps, by inode."""
    try:
        lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    except OSError:
        return set()
    return {line.split()[4] for line in lines if "memfd:splitserve-kv" in line}


@dataclass
class Context:
    """One deployment shared by the cases that leave it whole, and what was seen of it."""

    dep: Any
    ref: list[str]
    seen_pids: set[int] = field(default_factory=set)

    def pids(self) -> dict[str, int]:
        """name -> pid of every process: the router, each worker's front end and engine core."""
        out = {"router": self.dep.proc.pid}
        for w in self.dep.admin()["workers"]:
            out[f"{w['name']} front end"] = w["pid"]
            out[f"{w['name']} engine core"] = w["info"]["core_pid"]
        self.seen_pids |= set(out.values())
        return out

    def restarts(self, worker: str) -> int:
        return {w["name"]: w["restarts"] for w in self.dep.health()["workers"]}[worker]

    def wait_healthy(self, until: Any = None, timeout_s: float = 120.0) -> None:
        """Until every worker is ready (and `until()`, if given, holds)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                h = self.dep.health()
                ready = h["status"] == "ok" and all(w["state"] == "ready" for w in h["workers"])
                if ready and (until is None or until()):
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError("the deployment did not come back healthy")
            time.sleep(0.3)

    def check_after(self, streams: list[Stream], dead: set[int], any_failed_ok: bool = True) -> list[str]:
        """-> the problems: hung or wrong streams, pools not full, temp folders or mappings left."""
        problems = []
        hung = sum(s.outcome == "hung" for s in streams)
        if hung:
            problems.append(f"{hung} hung")
        for i, s in enumerate(streams):
            ref = self.ref[i % len(self.ref)]
            if (s.outcome == "ok" and s.text != ref) or not ref.startswith(s.text):
                problems.append(f"stream {i} wrong: {s.text[:40]!r} vs {ref[:40]!r}")
        if not any_failed_ok and any(s.outcome != "ok" for s in streams):
            problems.append("failed: " + ", ".join(sorted({s.outcome for s in streams if s.outcome != "ok"})))
        self.wait_healthy()
        try:
            stats = self.dep.wait_idle(timeout_s=60)
        except httpx.HTTPError:  # a worker restarted meanwhile: once more, from its new address
            self.wait_healthy()
            stats = self.dep.wait_idle(timeout_s=60)
        for name, st in stats.items():
            if st["unfinished"] or st["blocks"]["free"] != st["blocks"]["total"]:
                problems.append(f"{name} not idle: {st['unfinished']} left, {st['blocks']}")
        left = temp_leftovers(dead)
        if left:
            problems.append(f"temp folders left: {left}")
        return problems


def table(results: list[Result]) -> str:
    """The summary: one row per case, then the totals."""
    rows = [("case", "expected", "outcome", "result", "s")]
    rows += [(r.case, r.expected, r.outcome, "passed" if r.passed else "FAILED", f"{r.seconds:.1f}")
             for r in results]  # fmt: skip
    widths = [max(len(row[i]) for row in rows) for i in range(5)]
    lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) + " |" for row in rows]
    lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
    passed = sum(r.passed for r in results)
    lines.append(f"\n{len(results)} cases: {passed} passed, {len(results) - passed} failed")
    return "\n".join(lines)


__all__ = ["MODEL", "PROMPTS", "Context", "Result", "Stream", "memfd_inodes", "reference", "resilience",
           "serve", "table", "temp_leftovers", "under_load"]  # fmt: skip
