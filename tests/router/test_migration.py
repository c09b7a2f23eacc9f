"""Requests in flight survive a worker's fault (router/migrate.py), through a real disaggregated deployment
with its standby spare: a decode worker's engine core or front end killed with SIGKILL mid-stream, a
prefill worker's while it prefills. Every stream ends "ok" with the answer of a fault-free run, token for
token, greedy, seeded or held to a schema; the migrations are counted by cause; a request that arrives
while the worker restarts waits for it instead of a 503; nothing stays allocated afterwards. Streamed, the
first token is the prefill worker's (`router.first_token: prefill`): a decode worker killed after it, while
it fetches the KV, is a fault mid-stream, and the stream goes on from that token."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import time

import httpx
import pytest
from serve_harness import MODEL, SECRET, manifest_yaml, start_deployment

from splitserve.wire.auth import worker_headers

pytestmark = pytest.mark.slow

PROMPTS = [f"Write the numbers from {i} to {i + 60}, separated by commas:" for i in range(4)]
LONG_PROMPT = "Tell me a story about the sea. " * 120  # a prefill long enough to strike during
MAX_TOKENS = 64
LONG_MAX_TOKENS = 16  # the long prompts' faults strike their prefill: a short answer checks what follows


@pytest.fixture(scope="module")
def dep():
    d = start_deployment(
        manifest_yaml(
            mode="disaggregated",
            # no prefix cache: the fault-free reference run would leave the long prompts cached, and the
            # killed run's prefill would be over before the kill could strike it
            engine={"enable_prefix_caching": False},
            router={
                "timeouts": {"inter_token_s": 10, "kv_transfer_s": 10, "prefill_s": 30},
                "first_token": "prefill",
            },
            transport={"lease_s": 10},
            runtime={"standby": True, "worker_args": ["--enable-fault-injection"]},
        )
    )
    yield d
    assert d.stop() == 0, "\n".join(d.log)


@pytest.fixture(scope="module")
def ref(dep) -> list[list[str]]:
    """The fault-free answers to PROMPTS, asked once of the deployment as it started: every run with a
    fault, on restarted workers too, must end with these tokens."""
    return _reference(dep, PROMPTS)


NUMBERS = {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 999}, "minItems": 40}


def _sampling(prompt: str) -> dict:
    """Greedy, seeded sampling for every other prompt of PROMPTS, and one greedy answer held to a JSON
    schema (its grammar goes on where the failed worker left it)."""
    if prompt == PROMPTS[2]:
        return {"temperature": 0, "structured_outputs": {"json": NUMBERS}}
    return {"temperature": 0.8, "seed": 3} if prompt in PROMPTS[1::2] else {"temperature": 0}


def _body(prompt: str, stream: bool) -> dict:
    max_tokens = LONG_MAX_TOKENS if prompt.startswith(LONG_PROMPT) else MAX_TOKENS
    return {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "stream": stream, "ignore_eos": True,
            "logprobs": 0, **_sampling(prompt)}  # fmt: skip


def _reference(dep, prompts: list[str]) -> list[list[str]]:
    """The answers' tokens with no fault, the requests asked together (as the faulty runs ask theirs)."""

    async def one(client: httpx.AsyncClient, prompt: str) -> list[str]:
        r = await client.post(f"{dep.url}/v1/completions", json=_body(prompt, False))
        r.raise_for_status()
        return r.json()["choices"][0]["logprobs"]["tokens"]

    async def main() -> list[list[str]]:
        async with httpx.AsyncClient(timeout=120) as client:
            return list(await asyncio.gather(*(one(client, p) for p in prompts)))

    return asyncio.run(main())


async def _stream(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, list[str]]:
    """-> ("ok" or the error, the tokens streamed)."""
    tokens: list[str] = []
    async with client.stream("POST", f"{url}/v1/completions", json=_body(prompt, True)) as r:
        if r.status_code != 200:
            return f"status {r.status_code}", tokens
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            event = json.loads(line[6:])
            if "error" in event:
                return f"error {event['error'].get('code')}", tokens
            tokens += event["choices"][0]["logprobs"]["tokens"]
    return "ok", tokens


def _pid(dep, worker: str, process: str) -> int:
    w = {x["name"]: x for x in dep.admin()["workers"]}[worker]
    return w["pid"] if process == "front end" else w["info"]["core_pid"]


def _wait_streaming(dep, role: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not any(s["unfinished"] for n, s in dep.worker_stats().items() if n.startswith(role)):
        assert time.monotonic() < deadline, f"no request reached the {role} worker"
        time.sleep(0.02)


def _migrations(dep) -> float:
    text = httpx.get(f"{dep.url}/metrics?fresh=1", timeout=10).text  # the next snapshot, not the last
    return sum(
        float(m) for m in re.findall(r"^splitserve:request_migrations_total\{[^}]*\} (\S+)$", text, re.M)
    )


def _after(dep, worker: str, restarts: int) -> None:
    """The worker is back, and every pool is empty."""
    deadline = time.monotonic() + 90
    while True:
        h = dep.health()
        w = {x["name"]: x for x in h["workers"]}[worker]
        if h["status"] == "ok" and w["restarts"] > restarts:
            break
        assert time.monotonic() < deadline, h
        time.sleep(0.2)
    stats = dep.wait_idle(timeout_s=30)
    for name, s in stats.items():
        assert s["unfinished"] == 0 and s["blocks"]["free"] == s["blocks"]["total"], (name, s)


@pytest.mark.parametrize("process", ["engine core", "front end"])
def test_a_decode_worker_killed_mid_stream_costs_no_answer(dep, ref, process):
    restarts = {w["name"]: w["restarts"] for w in dep.health()["workers"]}["decode-0"]
    migrated = _migrations(dep)
    pid = _pid(dep, "decode-0", process)

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [asyncio.create_task(_stream(client, dep.url, p)) for p in PROMPTS]
            await asyncio.to_thread(_wait_streaming, dep, "decode")
            await asyncio.sleep(0.5)  # tokens are streaming
            os.kill(pid, signal.SIGKILL)
            await asyncio.sleep(0.2)
            late = await _stream(client, dep.url, PROMPTS[0])  # arrives while decode-0 restarts
            return await asyncio.gather(*jobs), late

    results, late = asyncio.run(main())
    for (outcome, tokens), expected in zip(results, ref, strict=True):
        assert outcome == "ok" and tokens == expected, (outcome, tokens, expected)
    assert late == ("ok", ref[0]), late
    assert _migrations(dep) > migrated
    _after(dep, "decode-0", restarts)


def test_a_prefill_worker_killed_while_it_prefills_costs_no_answer(dep):
    prompts = [LONG_PROMPT + f" Chapter {i}." for i in range(3)]
    ref = _reference(dep, prompts)
    restarts = {w["name"]: w["restarts"] for w in dep.health()["workers"]}["prefill-0"]
    pid = _pid(dep, "prefill-0", "engine core")

    async def main():
        async with httpx.AsyncClient(timeout=120) as client:
            jobs = [asyncio.create_task(_stream(client, dep.url, p)) for p in prompts]
            await asyncio.to_thread(_wait_streaming, dep, "prefill")
            os.kill(pid, signal.SIGKILL)
            return await asyncio.gather(*jobs)

    for (outcome, tokens), expected in zip(asyncio.run(main()), ref, strict=True):
        assert outcome == "ok" and tokens == expected, (outcome, tokens, expected)
    _after(dep, "prefill-0", restarts)


def _faults(dep, worker: str, knobs: dict) -> None:
    r = httpx.post(f"{dep.worker_urls()[worker]}/debug/faults", json=knobs, headers=worker_headers(SECRET),
                   timeout=10)  # fmt: skip
    assert r.status_code == 200, r.text


def test_a_decode_worker_killed_after_the_first_token_costs_no_answer(dep, ref):
    """The prefill worker serves each KV fetch 2 s late: the first token reaches the client while the
    decode worker still fetches (it is importing once the client has it, and no other token came), then
    the decode worker's engine core is killed; the choice migrates with that token and ends as without
    a fault, token for token."""
    expected = ref[0]
    restarts = {w["name"]: w["restarts"] for w in dep.health()["workers"]}["decode-0"]
    migrated = _migrations(dep)
    _faults(dep, "prefill-0", {"delay": 1.0, "delay_s": 2.0})
    tokens: list[str] = []
    try:
        url = f"{dep.url}/v1/completions"
        with httpx.stream("POST", url, json=_body(PROMPTS[0], True), timeout=120) as r:
            events = (json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {"))
            tokens += next(events)["choices"][0]["logprobs"]["tokens"]
            assert len(tokens) == 1
            deadline = time.monotonic() + 10
            while not dep.worker_stats()["decode-0"]["importing"]:
                assert time.monotonic() < deadline, "the decode worker never fetched"
                time.sleep(0.02)
            os.kill(_pid(dep, "decode-0", "engine core"), signal.SIGKILL)
            for event in events:
                assert "error" not in event, event
                tokens += event["choices"][0]["logprobs"]["tokens"]
    finally:
        _faults(dep, "prefill-0", {})
    assert tokens == expected
    assert _migrations(dep) == migrated + 1
    _after(dep, "decode-0", restarts)
