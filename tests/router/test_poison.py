"""One hostile request beside eight innocent ones, in both modes. Every hostile parameter of
the bad-input battery is refused at admission with a 400, and the eight greedy streams prefilling
beside it finish with exactly the text they get alone (unchecked, `top_k` 2^63 would fail the
prefill step of every request in it, and the innocents would get 400s)."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from serve_harness import MODEL, manifest_yaml, start_deployment

pytestmark = pytest.mark.slow

PROMPTS = [f"Count from {i} to {i + 9}, one number a line:" for i in range(8)]
HOSTILE = [  # raw JSON bodies, as a client can send them (test_bad_input.py has the rest of the battery)
    b'"top_k": 9223372036854775808',
    b'"seed": 18446744073709551616',
    b'"stop_token_ids": [99999999999]',
]


@pytest.fixture(scope="module")
def colocated_wide():
    dep = start_deployment(manifest_yaml(mode="colocated"))
    yield dep
    dep.stop()


async def _text(client: httpx.AsyncClient, url: str, headers: dict, prompt: str) -> str:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 0, "stream": True}
    out = []
    async with client.stream("POST", f"{url}/v1/completions", json=body, headers=headers) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if line.startswith("data: {"):
                out.append(httpx.Response(200, content=line[6:]).json()["choices"][0]["text"])
    return "".join(out)


@pytest.mark.parametrize("mode", ["disaggregated", "colocated"])
def test_one_hostile_request_never_hurts_the_innocent(mode, disaggregated, colocated_wide):
    dep = disaggregated if mode == "disaggregated" else colocated_wide
    headers = {"Content-Type": "application/json", **dep.headers()}

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            alone = [await _text(client, dep.url, headers, p) for p in PROMPTS[:2]]
            for field in HOSTILE:
                raw = (
                    b'{"model": "'
                    + MODEL.encode()
                    + b'", "prompt": "'
                    + PROMPTS[0].encode()
                    + b'", '
                    + field
                    + b"}"
                )
                innocent = [asyncio.create_task(_text(client, dep.url, headers, p)) for p in PROMPTS]
                hostile = await client.post(f"{dep.url}/v1/completions", content=raw, headers=headers)
                assert hostile.status_code == 400, (field, hostile.text)
                texts = await asyncio.gather(*innocent)
                assert texts[:2] == alone, field  # token-exact beside the hostile one
                assert all(texts), field

    asyncio.run(main())
    stats = dep.wait_idle()
    assert all(s["blocks"]["free"] == s["blocks"]["total"] for s in stats.values()), stats
