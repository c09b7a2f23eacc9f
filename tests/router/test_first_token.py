"""`router.first_token: prefill` on a real disaggregated deployment of the default model: a streamed
choice's first token is the prefill worker's, sent before the decode worker fetches the KV, and the
decode stream goes on after it. Streamed greedy answers equal colocated ones token for token and text for
text (logprobs, n=2, a stop string across the first two tokens), the TTFT headers leave the transfer out
while the KV-transfer metrics still count each transfer, and a non-streamed answer is as before."""

from __future__ import annotations

import json
import re

import httpx
import pytest
from serve_harness import MODEL

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def _sse(dep, path: str, body: dict) -> tuple[httpx.Headers, list[dict]]:
    with httpx.stream("POST", f"{dep.url}/v1/{path}", json={**body, "stream": True}, headers=dep.headers(),
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert not [e for e in events if "error" in e], events
    return r.headers, events


def _completions(dep, **body) -> dict[int, dict]:
    """Each streamed choice: its text, tokens, logprobs and finish reason, and how many chunks it took."""
    _, events = _sse(dep, "completions", {"model": MODEL, "prompt": PROMPT, "temperature": 0, **body})
    out: dict[int, dict] = {}
    for e in events:
        for ch in e["choices"]:
            c = out.setdefault(ch["index"], {"text": "", "tokens": [], "logprobs": [], "finish": None})
            c["text"] += ch["text"]
            if ch["logprobs"]:
                c["tokens"] += ch["logprobs"]["tokens"]
                c["logprobs"] += ch["logprobs"]["token_logprobs"]
            c["finish"] = ch["finish_reason"] or c["finish"]
    return out


def _same(got: dict[int, dict], want: dict[int, dict]) -> None:
    assert sorted(got) == sorted(want)
    for i, c in want.items():
        g = got[i]
        assert (g["text"], g["tokens"], g["finish"]) == (c["text"], c["tokens"], c["finish"]), (g, c)
        assert g["logprobs"] == pytest.approx(c["logprobs"], abs=1e-4)


def test_streamed_greedy_choices_equal_colocated(disaggregated, colocated):
    body = {"max_tokens": 12, "n": 2, "logprobs": 2}
    want = _completions(colocated, **body)
    assert len(want[0]["tokens"]) == 12 and want[0]["text"]
    _same(_completions(disaggregated, **body), want)
    whole = httpx.post(f"{disaggregated.url}/v1/completions", headers=disaggregated.headers(), timeout=120,
                       json={"model": MODEL, "prompt": PROMPT, "temperature": 0, **body}).json()  # fmt: skip
    assert [c["text"] for c in whole["choices"]] == [want[0]["text"], want[1]["text"]]


@pytest.mark.parametrize("include", [False, True])
def test_a_stop_string_across_the_first_two_tokens(disaggregated, colocated, include):
    """The prefill worker holds back the first token's last character (it may begin the stop string);
    the decode worker's second token completes it: the stream ends there, as colocated."""
    ref = _completions(colocated, max_tokens=8, logprobs=0)[0]["tokens"]
    first, second = ref[0], ref[1]
    assert first and second and first[-1] + second[0] not in first, ref
    body = {"max_tokens": 8, "logprobs": 0, "stop": [first[-1] + second[0]],
            "include_stop_str_in_output": include}  # fmt: skip
    want = _completions(colocated, **body)
    assert want[0]["finish"] == "stop" and want[0]["text"] == (first + second[0] if include else first[:-1])
    _same(_completions(disaggregated, **body), want)


def test_streamed_chat_with_logprobs_equals_colocated(disaggregated, colocated):
    messages = [{"role": "user", "content": "Name three colours."}]
    body = {"model": MODEL, "messages": messages, "max_tokens": 10, "temperature": 0, "n": 2,
            "logprobs": True, "top_logprobs": 1}  # fmt: skip

    def answers(dep) -> list[tuple[str, list[str]]]:
        _, events = _sse(dep, "chat/completions", body)
        out = {0: ("", []), 1: ("", [])}
        for e in events:
            for ch in e["choices"]:
                text, tokens = out[ch["index"]]
                content = (ch["logprobs"] or {}).get("content") or []
                text += ch["delta"].get("content") or ""
                out[ch["index"]] = (text, tokens + [x["token"] for x in content])
        return [out[0], out[1]]

    want = answers(colocated)
    assert len(want[0][1]) == 10
    assert answers(disaggregated) == want


def _sum(text: str, name: str, *labels: str) -> float:
    pattern = rf"^{re.escape(name)}\{{([^}}]*)\}} (\S+)$"
    return sum(float(v) for lab, v in re.findall(pattern, text, re.M) if all(x in lab for x in labels))


def test_the_first_chunk_leaves_the_transfer_out_of_ttft_but_the_transfer_is_counted(disaggregated):
    def metrics() -> tuple[float, float, float]:
        text = httpx.get(f"{disaggregated.url}/metrics?fresh=1", timeout=10).text
        return (
            _sum(text, "splitserve:kv_transfers_total", 'backend="shm"', 'outcome="ok"'),
            _sum(text, "splitserve:kv_transfer_seconds_count", 'backend="shm"'),
            _sum(text, "vllm:nixl_xfer_time_seconds_count", 'backend="shm"'),
        )

    before = metrics()
    body = {"model": MODEL, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    h, _ = _sse(disaggregated, "completions", body)
    assert h["x-splitserve-kv-backend"] == "shm" and float(h["x-splitserve-ttft-prefill-ms"]) > 0
    assert "x-splitserve-ttft-transfer-ms" not in h, h  # the first token did not wait for the KV
    assert [a - b for a, b in zip(metrics(), before, strict=True)] == [1, 1, 1]
    # a non-streamed answer waits for the decode worker, as before: its TTFT holds the transfer
    url, headers = f"{disaggregated.url}/v1/completions", disaggregated.headers()
    r = httpx.post(url, json=body, headers=headers, timeout=60)
    assert r.status_code == 200 and float(r.headers["x-splitserve-ttft-transfer-ms"]) >= 0
    assert [a - b for a, b in zip(metrics(), before, strict=True)] == [2, 2, 2]
