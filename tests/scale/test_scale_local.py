"""The scaling controller on a real local deployment (1 prefill + 1 decode worker, each pool allowed a
second). The SLOs (TTFT 5 ms, ITL 1 ms) are under what one model step of the tiny model takes on any CPU,
so every request breaks them; whether a figure is judged at all is set by how many were observed in the
window, which the load controls: prompt-heavy requests (one output token: no ITL) break TTFT and a
prefill worker is added; output-heavy ones then break ITL as well, prefill being at its maximum, and a
decode worker is added; a trickle slower than `min_requests` per window judges neither, and both extra
workers are drained and removed, one at a time. Each step may take as long as the signals' delays plus
three times the slowest worker start this deployment measured. Every answer, across every change, is
the engine's own greedy answer, and the decisions are on /metrics with their reasons."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import MODEL, manifest_yaml, start_deployment

from splitserve import SamplingParams

pytestmark = pytest.mark.slow

LONG = [f"Item {i}: " + "the quick brown fox jumps over the lazy dog. " * 10 for i in range(4)]  # ~110 tokens
SHORT = [f"Count from {i} upwards:" for i in range(4)]
LONG_TOKENS, SHORT_TOKENS = 1, 24
WINDOW_S, MIN_REQUESTS = 3, 3
TRICKLE_S = 1.5 * WINDOW_S / MIN_REQUESTS  # under MIN_REQUESTS first tokens in any window
SIGNALS_S = 20  # a window to fill, the cooldown, a few intervals


@pytest.fixture(scope="module")
def dep():
    pools = {"replicas": 1, "min_replicas": 1, "max_replicas": 2}
    d = start_deployment(
        manifest_yaml(
            mode="disaggregated",
            prefill=dict(pools),
            decode=dict(pools),
            engine={"enable_prefix_caching": False},
            router={"timeouts": {"inter_token_s": 30, "kv_transfer_s": 30, "prefill_s": 60}},
            # TTFT over 5 ms and ITL over 1 ms: broken by every request; fewer than 3 first tokens in
            # the 3 s window judge no TTFT (the trickle below: one request per TRICKLE_S at most)
            scaling={"enabled": True, "interval_s": 1, "window_s": WINDOW_S, "cooldown_s": 2,
                     "down_after_s": 3, "ttft_ms": 5, "itl_ms": 1, "min_requests": MIN_REQUESTS,
                     "max_waiting_per_replica": 1000},
        )
    )  # fmt: skip
    yield d
    assert d.stop() == 0, "\n".join(d.log)


def _ids(tok, prompt: str) -> list[int]:  # noqa: ANN001
    return tok.encode(prompt)


def _ready(dep, role: str) -> list[str]:  # noqa: ANN001
    return sorted(w["name"] for w in dep.admin()["workers"] if w["role"] == role and w["state"] == "ready")


def _decisions(dep) -> dict[tuple[str, str, str], float]:  # noqa: ANN001
    text = httpx.get(f"{dep.url}/metrics", timeout=10).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "splitserve:scaling_decisions_total":
                out[(s.labels["role"], s.labels["action"], s.labels["reason"])] = s.value
    return out


def _scaling_log(dep) -> str:  # noqa: ANN001
    return "\n".join(line for line in dep.log if "scaling:" in line or "local_scale" in line)


def _step_s(dep) -> float:  # noqa: ANN001
    """What one change of shape may take: the signals' delays and three times the slowest start of a
    worker this deployment measured (a loaded host starts the added worker as slowly)."""
    return SIGNALS_S + 3 * max(w["startup_s"] or 0.0 for w in dep.admin()["workers"])


async def _load(dep, prompts: list[list[int]], max_tokens: int, until, answers: list, workers: int,
                pause_s: float = 0.0) -> None:  # fmt: skip
    """`workers` clients asking `prompts` in turn until `until()`; every answer recorded."""
    timeout_s = _step_s(dep)
    end = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(k: int) -> None:
            i = k
            while not await asyncio.to_thread(until):
                if time.monotonic() > end:
                    pytest.fail(
                        f"no new shape in {timeout_s:.0f}s: {dep.admin()['workers']}\n{_scaling_log(dep)}"
                    )
                ids = prompts[i % len(prompts)]
                body = {"model": MODEL, "prompt": ids, "max_tokens": max_tokens, "temperature": 0}
                r = await client.post(f"{dep.url}/v1/completions", json=body)
                answers.append((i % len(prompts), max_tokens, r.status_code, r.json()))
                i += workers
                await asyncio.sleep(pause_s)

        await asyncio.gather(*(one(k) for k in range(workers)))


def _roles(dep) -> list[tuple[str, str]]:  # noqa: ANN001
    return sorted((w["role"], w["state"]) for w in dep.admin()["workers"])


def test_load_up_adds_prefill_then_decode_and_load_down_removes_them(dep, make_smol_llm):
    llm = make_smol_llm()
    tok = llm.engine.tokenizer
    long_ids = [_ids(tok, p) for p in LONG]
    short_ids = [_ids(tok, p) for p in SHORT]
    want = {
        LONG_TOKENS: [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": i} for i in long_ids],
                                                              SamplingParams(temperature=0, max_tokens=1))],
        SHORT_TOKENS: [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": i} for i in short_ids],
                                                               SamplingParams(temperature=0, max_tokens=24))],
    }  # fmt: skip
    answers: list = []
    # prompt-heavy: TTFT breaks, no ITL is observed -> a second prefill worker
    asyncio.run(_load(dep, long_ids, LONG_TOKENS, lambda: len(_ready(dep, "prefill")) == 2, answers, 4))
    assert _ready(dep, "decode") == ["decode-0"]
    # output-heavy: ITL breaks too; prefill is at its maximum -> a second decode worker
    asyncio.run(_load(dep, short_ids, SHORT_TOKENS, lambda: len(_ready(dep, "decode")) == 2, answers, 3))
    assert _ready(dep, "prefill") == ["prefill-0", "prefill-1"]
    # a trickle (too few first tokens to judge TTFT, no ITL): both extra workers drained and removed
    # (which of a role's two goes is the drain's pick: the one with less in flight)
    shrunk = lambda: _roles(dep) == [("decode", "ready"), ("prefill", "ready")]  # noqa: E731
    asyncio.run(_load(dep, long_ids, LONG_TOKENS, shrunk, answers, 1, pause_s=TRICKLE_S))

    bad = [(i, n, status, body) for i, n, status, body in answers
           if status != 200 or body["choices"][0]["text"] != want[n][i]]  # fmt: skip
    assert not bad and len(answers) > 10, bad[:3]
    made = {k: v for k, v in _decisions(dep).items() if k[1] != "hold"}
    assert made == {  # one change each: no flapping
        ("prefill", "add", "ttft_slo"): 1,
        ("decode", "add", "itl_slo"): 1,
        ("prefill", "remove", "low_load"): 1,
        ("decode", "remove", "low_load"): 1,
    }, _scaling_log(dep)
    stats = dep.wait_idle()
    assert all(s["blocks"]["free"] == s["blocks"]["total"] for s in stats.values()), stats
