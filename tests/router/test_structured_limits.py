"""Costly grammars contained, through a real disaggregated deployment: a 100,000-value enum, a
100,000-entry guided_choice, a nested quantifier and a million-fold repetition are each a 400 naming its
limit, answered at the router, while two plain streams run beside them and finish; constrained requests
after them answer. A grammar within the limits that does not compile by `compile_timeout_s` is a 503,
its request holds nothing afterwards, and the bystanders are untouched. (Their latency beside it, against
a trivially refused request: bench/grammar_flood.py.)"""

from __future__ import annotations

import asyncio
import json

import openai
import pytest
from serve_harness import manifest_yaml, start_deployment

MODEL = "random:tiny-chat"
MESSAGES = [{"role": "user", "content": "Give me the answer."}]
HOSTILE = [  # (extra body, the limit named, the field named)
    ({"guided_json": {"enum": [f"v{i}" for i in range(100_000)]}}, "max_enum_values", "guided_json"),
    ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "max_choices", "guided_choice"),
    ({"guided_regex": "^(a+)+$"}, "allow_nested_quantifiers", "guided_regex"),
    ({"guided_regex": "^a{1000000}$"}, "max_repetition", "guided_regex"),
]
# within the limits below, and slower to compile than the deadline (a 30,000-value enum: seconds)
SLOW = {"guided_json": {"enum": [f"slow{i}" for i in range(30_000)]}}


@pytest.fixture(scope="module")
def dep():
    d = start_deployment(
        manifest_yaml(
            mode="disaggregated",
            model={"source": MODEL, "max_model_len": 512},
            engine={"kv_cache_mb": 16, "max_num_seqs": 32},
            server={
                "port": 0,
                "structured": {
                    "max_enum_values": 40_000,
                    "max_schema_bytes": 1 << 20,
                    "compile_timeout_s": 1.0,
                },
            },
        )
    )
    yield d
    assert d.stop() == 0, "\n".join(d.log)


async def _bystander(client: openai.AsyncOpenAI, seed: int) -> str | None:
    reason = None
    stream = await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=48, seed=seed, stream=True, extra_body={"ignore_eos": True}
    )
    async for chunk in stream:
        for ch in chunk.choices:
            reason = ch.finish_reason or reason
    return reason


async def _refusal(client: openai.AsyncOpenAI, extra: dict) -> openai.APIStatusError | None:
    try:
        await client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, extra_body=extra)
    except openai.APIStatusError as exc:
        return exc
    return None


def test_costly_grammars_are_400s_beside_bystanders(dep):
    client = dep.async_client(timeout=5.0)  # each answer within 5 s, or the client raises

    async def main():
        bystanders = [asyncio.create_task(_bystander(dep.async_client(timeout=120), s)) for s in (1, 2)]
        refusals = await asyncio.gather(*(_refusal(client, extra) for extra, _, _ in HOSTILE))
        return refusals, await asyncio.gather(*bystanders)

    refusals, reasons = asyncio.run(main())
    for err, (_, limit, field) in zip(refusals, HOSTILE, strict=True):
        assert err is not None and err.status_code == 400, (limit, err)
        assert (
            limit in err.message and err.body["param"] == field and err.body["code"] == "grammar_too_complex"
        )
    assert reasons == ["length", "length"]
    _constrained_requests_answer(dep)


def test_a_compile_past_its_deadline_is_a_503_and_holds_nothing(dep):
    async def main():
        bystander = asyncio.create_task(_bystander(dep.async_client(timeout=120), 3))
        err = await _refusal(dep.async_client(timeout=10.0), SLOW)
        return err, await bystander

    err, reason = asyncio.run(main())
    assert err is not None and err.status_code == 503 and "compile" in err.message, err
    assert reason == "length"
    _constrained_requests_answer(dep)
    stats = dep.wait_idle(60)
    assert all(s["blocks"]["free"] == s["blocks"]["total"] and s["unfinished"] == 0 for s in stats.values())


def _constrained_requests_answer(dep) -> None:
    client = dep.client(timeout=60)
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "seed": 4}
    r = client.chat.completions.create(**kw, extra_body={"guided_regex": "[0-9]{3}"})
    assert len(r.choices[0].message.content) == 3 and r.choices[0].message.content.isdigit()
    r = client.chat.completions.create(**kw, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(**{**kw, "max_tokens": 40}, response_format={"type": "json_object"})
    text = r.choices[0].message.content
    assert text.startswith("{") and (
        r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    )
