"""Clients that go away, workers killed under load, shutdown: nothing hangs, leaks or answers wrongly."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import httpx
import openai
import pytest
from serve_harness import MODEL, manifest_yaml, start_deployment

pytestmark = pytest.mark.slow

LONG = {
    "model": MODEL,
    "prompt": "List every number from one to a thousand:",
    "temperature": 0,
    "ignore_eos": True,
}


def _busy(dep) -> bool:
    return any(s["unfinished"] for s in dep.worker_stats().values())


def _wait_busy(dep, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not _busy(dep):
        assert time.monotonic() < deadline, "the request never reached a worker"
        time.sleep(0.05)


def test_client_disconnect_mid_stream_frees_both_workers(disaggregated):
    body = {**LONG, "max_tokens": 1500, "stream": True}
    with httpx.stream(
        "POST", f"{disaggregated.url}/v1/completions", json=body, headers=disaggregated.headers(), timeout=60
    ) as r:
        assert r.status_code == 200
        lines = r.iter_lines()
        got = [next(lines) for _ in range(6)]  # some tokens streamed: the decode worker is generating
        assert all(line.startswith("data: ") or not line for line in got)
    # 1,500 tokens would take a minute: idle within seconds means the request was aborted, not finished
    stats = disaggregated.wait_idle(timeout_s=10)
    for name, s in stats.items():
        assert s["unfinished"] == 0 and s["running"] == 0, (name, s)
        assert s["blocks"]["free"] == s["blocks"]["total"], (name, s)


def test_client_disconnect_while_waiting_non_streaming(disaggregated):
    body = {**LONG, "max_tokens": 1500}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{disaggregated.url}/v1/completions", json=body, headers=disaggregated.headers(), timeout=3
        )
    stats = disaggregated.wait_idle(timeout_s=10)
    for name, s in stats.items():
        assert s["unfinished"] == 0 and s["blocks"]["free"] == s["blocks"]["total"], (name, s)


@pytest.fixture(scope="module")
def fragile():
    """Its own deployment (workers get killed here, and come back from the standby spare), with short
    deadlines, and the `fail` policy: a request on a worker that dies ends with an error instead of
    migrating (test_migration.py has the default)."""
    manifest = manifest_yaml(
        mode="disaggregated",
        router={"timeouts": {"inter_token_s": 10, "kv_transfer_s": 10, "prefill_s": 30}, "on_fault": "fail"},
        transport={"lease_s": 10},
        runtime={"standby": True},
    )
    dep = start_deployment(manifest)
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)


async def _stream_until_end(client: openai.AsyncOpenAI, prompt: str, max_tokens: int) -> tuple[str, float]:
    """-> ("ok" | the error's class name, time.monotonic() when it ended)."""
    try:
        stream = await client.completions.create(
            model=MODEL,
            prompt=prompt,
            temperature=0,
            max_tokens=max_tokens,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        async for _ in stream:
            pass
        return "ok", time.monotonic()
    except openai.APIError as exc:
        return type(exc).__name__, time.monotonic()


def _wait_role_busy(dep, role: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(s["unfinished"] for n, s in dep.worker_stats().items() if n.startswith(role)):
        assert time.monotonic() < deadline, f"no request reached the {role} worker"
        time.sleep(0.02)


# decode-0 dies while the requests are generating; prefill-0 while long prompts are being prefilled
VICTIMS = {"decode-0": (LONG["prompt"], 150), "prefill-0": ("Tell me a story. " * 300, 8)}


@pytest.mark.parametrize("victim,process", [(v, p) for v in VICTIMS for p in ("front end", "engine core")])
def test_sigkill_a_worker_under_load(fragile, victim, process):
    """Either process of a worker dies (its front end, or the engine core behind it): the requests on
    it fail within their deadline, the worker is restarted whole, nothing leaks."""
    before = {w["name"]: w for w in fragile.admin()["workers"]}
    pid = before[victim]["pid"] if process == "front end" else before[victim]["info"]["core_pid"]
    prompt, max_tokens = VICTIMS[victim]
    killed_at = 0.0

    async def main() -> list[tuple[str, float]]:
        nonlocal killed_at
        client = fragile.async_client(timeout=120)
        jobs = [asyncio.create_task(_stream_until_end(client, prompt, max_tokens)) for _ in range(4)]
        await asyncio.to_thread(_wait_role_busy, fragile, victim.split("-")[0])
        if victim.startswith("decode"):
            await asyncio.sleep(1.0)  # tokens are streaming
        os.kill(pid, signal.SIGKILL)
        killed_at = time.monotonic()
        return await asyncio.gather(*jobs)

    results = asyncio.run(main())
    failed = [(outcome, end - killed_at) for outcome, end in results if outcome != "ok"]
    assert failed, results  # the requests on the killed worker failed, with a clear error ...
    assert all(after < 15 for _, after in failed), failed  # ... within their deadline (inter_token_s 10)
    assert all(outcome in ("APIError", "InternalServerError", "APIStatusError") for outcome, _ in failed), (
        failed
    )
    # the worker comes back, and later requests succeed
    deadline = time.monotonic() + 90
    while True:
        health = fragile.health()
        w = {x["name"]: x for x in health["workers"]}[victim]
        if health["status"] == "ok" and w["restarts"] == before[victim]["restarts"] + 1:
            break
        assert time.monotonic() < deadline, health
        time.sleep(0.2)
    back_in = time.monotonic() - killed_at
    info = {x["name"]: x for x in fragile.admin()["workers"]}[victim]["info"]
    load = info["load"]
    print(
        f"{victim}'s {process} killed; back ready in {back_in:.1f}s (spawn to ready "
        f"{w['startup_s']:.1f}s, from the "
        f"standby process: {info['from_standby']}; weights {load['method']}, "
        f"cache {load['cache']['status']}, "
        f"{load['total_seconds']:.2f}s)"
    )
    assert load["cache"]["status"] == "hit"  # the restart mapped the host-side weight cache ...
    assert info["from_standby"]  # ... in the warm spare process (its imports were done)
    client = fragile.client(timeout=60)
    for _ in range(3):
        r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
        assert r.choices[0].finish_reason == "length"
    # nothing leaked on either worker (the killed one is new; the survivor must be whole)
    stats = fragile.wait_idle(timeout_s=20)
    for name, s in stats.items():
        assert s["unfinished"] == 0 and s["blocks"]["free"] == s["blocks"]["total"], (name, s)
    metrics = httpx.get(f"{fragile.url}/metrics", headers=fragile.headers(), timeout=10).text
    assert "splitserve:worker_up" in metrics


def _worker_pids(dep) -> list[int]:
    """Every process of every worker: front ends and their engine cores."""
    workers = dep.admin()["workers"]
    return [w["pid"] for w in workers] + [w["info"]["core_pid"] for w in workers]


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:  # a zombie is gone too (nobody may reap it until its parent exits)
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1].startswith("Z")
    except (OSError, IndexError):
        return True


def test_sigkill_of_the_router_under_load_leaves_no_process():
    """The router (`splitserve serve`) dies under load: its clients see the connection end at once, and
    every worker process, front end and engine core, goes within seconds (PR_SET_PDEATHSIG)."""
    dep = start_deployment(manifest_yaml(mode="disaggregated"))
    pids = _worker_pids(dep)

    async def main() -> list[tuple[str, float]]:
        client = dep.async_client(timeout=60)
        jobs = [asyncio.create_task(_stream_until_end(client, LONG["prompt"], 150)) for _ in range(4)]
        await asyncio.to_thread(_wait_busy, dep)
        dep.proc.send_signal(signal.SIGKILL)
        killed = time.monotonic()
        return [(outcome, end - killed) for outcome, end in await asyncio.gather(*jobs)]

    try:
        results = asyncio.run(main())
    finally:
        dep.stop()  # the router is killed (or, if the test broke first, it is stopped here)
    assert all(outcome != "ok" and after < 5 for outcome, after in results), results
    deadline = time.monotonic() + 20
    while not all(_gone(p) for p in pids):
        assert time.monotonic() < deadline, [p for p in pids if not _gone(p)]
        time.sleep(0.2)


def test_sigterm_drains_then_ends_open_streams_at_the_deadline_and_stops_workers():
    """SIGTERM with requests in flight: a request that finishes within `drain_timeout_s` is answered whole
    (the drain), a stream still running at the deadline is not cut mid-body: it ends with an SSE error
    event and [DONE]; the server stops at the deadline with code 0, and every worker process, front end
    and engine core, is gone."""
    dep = start_deployment(manifest_yaml(mode="colocated", runtime={"drain_timeout_s": 2}))
    pids = _worker_pids(dep)
    body = {**LONG, "max_tokens": 1500, "stream": True}
    lines: list[str] = []
    with ThreadPoolExecutor(1) as pool:
        short: Future[str] | None = None
        with httpx.stream("POST", f"{dep.url}/v1/completions", json=body, timeout=60) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue  # the blank line after each event: one SIGTERM only (a second skips the drain)
                lines.append(line[6:])
                if len(lines) == 3:  # the stream is generating: a short request joins it, then SIGTERM
                    short = pool.submit(_finish_reason, dep, 8)
                    _wait_unfinished(dep, 2)
                    dep.proc.send_signal(signal.SIGTERM)
                    stopped = time.monotonic()
        assert short is not None and short.result() == "length"  # in flight at SIGTERM: finished
    assert lines[-1] == "[DONE]", lines[-3:]
    error = json.loads(lines[-2])
    assert error["error"]["code"] == "server_shutdown" and error["status"] == 503, error
    assert dep.proc.wait(30) == 0
    assert time.monotonic() - stopped < 10
    for pid in pids:  # front ends and engine cores alike
        assert _gone(pid), pid


def _finish_reason(dep, max_tokens: int) -> str:
    r = dep.client(timeout=60).completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=max_tokens, temperature=0
    )
    return r.choices[0].finish_reason


def _wait_unfinished(dep, n: int, timeout_s: float = 30.0) -> None:
    """Until the workers hold `n` unfinished requests between them."""
    deadline = time.monotonic() + timeout_s
    while sum(s["unfinished"] for s in dep.worker_stats().values()) < n:
        assert time.monotonic() < deadline, f"fewer than {n} requests reached the workers"
        time.sleep(0.02)
