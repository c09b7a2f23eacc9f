"""The access log line says what the client saw: a /v1/responses line carries the `resp_` id the
client got (streamed or not), and a refused request logs `ttft_ms=-`."""

from __future__ import annotations

import time

import httpx
from serve_harness import MODEL


def _line_with(dep, needle: str) -> str:
    deadline = time.monotonic() + 10
    while True:
        for line in list(dep.log):
            if needle in line:
                return line
        assert time.monotonic() < deadline, (needle, list(dep.log)[-10:])
        time.sleep(0.2)


def test_responses_lines_carry_the_resp_id_and_refusals_a_dash(disaggregated):
    url, h = disaggregated.url, disaggregated.headers()
    body = {"model": MODEL, "input": "Hi", "max_output_tokens": 4}
    rid = httpx.post(f"{url}/v1/responses", json=body, headers=h, timeout=60).json()["id"]
    assert rid.startswith("resp_")
    assert "POST /v1/responses 200" in _line_with(disaggregated, rid)
    raw = httpx.post(f"{url}/v1/responses", json={**body, "stream": True}, headers=h, timeout=60).text
    streamed = raw.split('"id":"', 2)[1].split('"', 1)[0]  # response.created's response id
    assert streamed.startswith("resp_") and "/v1/responses" in _line_with(disaggregated, streamed)
    r = httpx.post(f"{url}/v1/chat/completions", json={"model": MODEL, "messages": []}, headers=h, timeout=10)
    assert r.status_code == 400
    assert "ttft_ms=-" in _line_with(disaggregated, "POST /v1/chat/completions 400")
    assert not any("ttft_ms=None" in line for line in disaggregated.log)
