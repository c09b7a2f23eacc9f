"""A step that raises despite admission checks fails only the request it is pinned on.

A test hook (SPLITSERVE_TEST_STEP_FAULT_TOKEN, read by the engine's isolate.py, off unless set) makes
any step that computes one token raise. One request carrying it is sent while eight innocent streams
share its steps: it gets a 5xx (an internal error, not "invalid request"), the eight finish with
exactly the text they get alone, and the pools are full afterwards. Before, the core failed every
request of the step."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
from serve_harness import MODEL, manifest_yaml, start_deployment

pytestmark = pytest.mark.slow

POISON = 48123  # a token none of the innocent prompts or answers contains
FILLER = "Here is a short note about numbers. " * 24  # ~200 tokens: prefill spans steps of 64
PROMPTS = [f"{FILLER}Count from {i} to {i + 9}, one number a line:" for i in range(8)]


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def faulty(request):
    os.environ["SPLITSERVE_TEST_STEP_FAULT_TOKEN"] = str(POISON)
    try:
        dep = start_deployment(manifest_yaml(mode=request.param, engine={"max_num_batched_tokens": 64}))
    finally:
        del os.environ["SPLITSERVE_TEST_STEP_FAULT_TOKEN"]
    yield dep
    dep.stop()


async def _text(client: httpx.AsyncClient, url: str, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0, "stream": True}
    out = []
    async with client.stream("POST", f"{url}/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                choice = httpx.Response(200, content=line[6:]).json()["choices"][0]
                out.append(choice["text"])
            elif line.startswith("data: ") and line != "data: [DONE]":
                raise AssertionError(line)  # an error event
    return "".join(out)


def test_a_step_fault_fails_only_its_request(faulty):
    dep = faulty

    async def main() -> None:
        async with httpx.AsyncClient(timeout=180) as client:
            alone = [await _text(client, dep.url, p) for p in PROMPTS[:2]]
            innocent = [asyncio.create_task(_text(client, dep.url, p)) for p in PROMPTS]
            await asyncio.sleep(0.3)  # the innocents are prefilling (64 tokens a step) or decoding
            poison = {"model": MODEL, "prompt": [POISON, 28, 29, 30] * 4, "max_tokens": 4, "temperature": 0}
            r = await client.post(f"{dep.url}/v1/completions", json=poison)
            texts = await asyncio.gather(*innocent, return_exceptions=True)
            assert texts[:2] == alone, texts  # token-exact beside the poison, and none failed
            assert all(isinstance(t, str) and t for t in texts), texts
            assert r.status_code in (500, 502), r.text  # the worker's 500, as the router relays it
            error = r.json()["error"]
            assert error["type"] == "server_error" and error["code"] == "internal", error
            assert "engine failed while running this request" in error["message"], error

    asyncio.run(main())
    stats = dep.wait_idle()
    assert all(s["blocks"]["free"] == s["blocks"]["total"] for s in stats.values()), stats
    assert any("re-running its requests one by one" in line for line in dep.log), list(dep.log)[-20:]
