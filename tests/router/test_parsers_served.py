"""The parsers in a served deployment: a random-weight tiny Qwen3.5 whose tokenizer carries Qwen3.5's own
chat template (tests/fixtures/qwen3_5), served colocated and disaggregated (1 prefill + 1 decode). The
parsers come from the template (`qwen3_coder`, `qwen3`); a parser that does not fit it stops the start,
naming the one that does. Random weights write no meaningful calls, so what is checked is what the
parsers and the grammar guarantee: the thinking apart from the answer, streamed as unstreamed; forced
calls after a bounded thinking that parse and validate, 100 of 100; a JSON-schema answer after the
thinking; and the disaggregated deployment's answers equal to the colocated one's, seed for seed."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import jsonschema
import openai
import pytest
from serve_harness import manifest_yaml

from splitserve.config.manifest import parse_manifest
from splitserve.runtime.process import start_serve

CITY, DAYS = {"type": "string", "maxLength": 12}, {"type": "integer", "minimum": 1, "maximum": 14}
PARAMS = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
          "properties": {"city": CITY, "days": DAYS}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]


def test_thinking_apart_streamed_as_unstreamed(qwen_served):
    client = qwen_served.client(timeout=120)
    kw = {
        "model": qwen_served.client().models.list().data[0].id,
        "messages": ASK,
        "temperature": 0,
        "max_tokens": 12,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    msg = whole.message.model_dump()
    # the template opened <think>: a short random answer never closes it, so it is all reasoning
    assert (
        msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"] and msg["content"] is None
    )
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert (reasoning, content or None) == (msg["reasoning_content"], msg["content"])
    off = client.chat.completions.create(
        **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    off_msg = off.choices[0].message.model_dump()
    assert off_msg["content"] and not off_msg.get("reasoning_content")  # the template closed the block


async def _answer(client: Any, kw: dict[str, Any], stream: bool) -> dict[str, Any]:
    """One chat answer as its parts, from the whole message or joined from the stream's deltas."""
    if not stream:
        r = await client.chat.completions.create(**kw)
        msg = r.choices[0].message.model_dump()
        calls = [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []]
        return {"reasoning": msg.get("reasoning_content"), "content": msg["content"], "calls": calls,
                "finish": r.choices[0].finish_reason,
                "thought": r.usage.completion_tokens_details.reasoning_tokens}  # fmt: skip
    out: dict[str, Any] = {"reasoning": "", "content": "", "calls": {}, "finish": None, "thought": None}
    chunks = await client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True})
    async for chunk in chunks:
        if chunk.usage is not None:
            out["thought"] = chunk.usage.completion_tokens_details.reasoning_tokens
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            out["reasoning"] += delta.get("reasoning_content") or ""
            out["content"] += delta.get("content") or ""
            out["finish"] = choice.finish_reason or out["finish"]
            for tc in delta.get("tool_calls") or []:
                name, args = out["calls"].get(tc["index"], ("", ""))
                fn = tc["function"]
                out["calls"][tc["index"]] = (
                    name + (fn.get("name") or ""),
                    args + (fn.get("arguments") or ""),
                )
    calls = [out["calls"][i] for i in sorted(out["calls"])]
    return {**out, "reasoning": out["reasoning"] or None, "content": out["content"] or None, "calls": calls}


def _answers(
    deps: tuple[Any, ...], kws: list[dict[str, Any]], streams: tuple[bool, ...], at_once: int = 32
) -> list[list[dict[str, Any]]]:
    """Each deployment's answer to each request (`streams`: whether each deployment is asked streamed), the
    deployments asked side by side (their processes share the CPU), `at_once` requests in flight on each:
    100 at once would hold more KV than the decode worker's pool, and an import that waits past its
    deadline for room is a 503 under the `fail` policy."""

    async def on(dep: Any, stream: bool) -> list[dict[str, Any]]:
        gate = asyncio.Semaphore(at_once)
        async with dep.async_client(timeout=300) as client:
            model = (await client.models.list()).data[0].id

            async def one(kw: dict[str, Any]) -> dict[str, Any]:
                async with gate:
                    return await _answer(client, {"model": model, **kw}, stream)

            return await asyncio.gather(*(one(kw) for kw in kws))

    async def run() -> list[list[dict[str, Any]]]:
        return await asyncio.gather(*(on(dep, stream) for dep, stream in zip(deps, streams, strict=True)))

    return asyncio.run(run())


NAMED = {"type": "function", "function": {"name": "get_weather"}}


@pytest.mark.parametrize(
    "choice, streams", [("required", (False, True)), ("named", (True, False))], ids=["required", "named"]
)
def test_forced_calls_after_bounded_thinking_100_of_100_split_as_colocated(
    qwen_served, qwen_split, choice, streams
):
    """tool_choice required and a named function: after a thinking bounded to 0..7 tokens, Qwen3.5's XML
    call held to the schema by the grammar and read by the XML parser, 100 sampled answers of 100 (seeds),
    no XML left in content; the disaggregated deployment's answers equal the colocated one's. One side is
    asked streamed and the other whole, crossed between the two choices (each deployment answers one
    choice streamed and the other whole), so that the equality also holds the streamed parse to the
    unstreamed one."""
    kws = [{"messages": ASK, "tools": TOOLS, "tool_choice": NAMED if choice == "named" else "required",
            "temperature": 1.0, "seed": seed, "max_tokens": 200, "parallel_tool_calls": False,
            "extra_body": {"thinking_token_budget": seed % 8}} for seed in range(100)]  # fmt: skip
    colocated, split = _answers((qwen_served, qwen_split), kws, streams)
    assert split == colocated
    for answer in colocated:
        assert answer["finish"] == "tool_calls" and answer["content"] is None, answer
        ((name, arguments),) = answer["calls"]
        assert name == "get_weather" and "<parameter=" not in arguments, answer
        jsonschema.validate(json.loads(arguments), PARAMS)
        assert "</think>" not in (answer["reasoning"] or "") and answer["thought"] > 0, answer


CITY_SCHEMA = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
               "properties": {"city": CITY, "days": DAYS}}  # fmt: skip


@pytest.mark.parametrize("stream", [False, True])
def test_a_json_schema_answer_after_bounded_thinking_split_as_colocated(qwen_served, qwen_split, stream):
    """response_format json_schema with thinking on and a thinking budget: the reasoning apart, the content
    valid against the schema, reasoning_tokens the budget and the forced end; split equals colocated."""
    fmt = {"type": "json_schema", "json_schema": {"name": "trip", "schema": CITY_SCHEMA, "strict": True}}
    kws = [{"messages": ASK, "response_format": fmt, "temperature": 1.0, "seed": seed, "max_tokens": 120,
            "extra_body": {"thinking_token_budget": 3 + seed}} for seed in range(12)]  # fmt: skip
    colocated, split = _answers((qwen_served, qwen_split), kws, (stream, stream))
    assert split == colocated
    for kw, answer in zip(kws, colocated, strict=True):
        budget = kw["extra_body"]["thinking_token_budget"]
        assert answer["finish"] == "stop" and answer["reasoning"] and not answer["calls"], answer
        jsonschema.validate(json.loads(answer["content"]), CITY_SCHEMA)
        assert answer["thought"] == budget + 4, (
            answer
        )  # the forced "\n</think>" is 4 tokens of this vocabulary


def test_reasoning_effort_maps_onto_the_template_switch(qwen_served):
    client = qwen_served.client(timeout=120)
    kw = {"model": client.models.list().data[0].id, "messages": ASK, "temperature": 0, "max_tokens": 8}
    off = client.chat.completions.create(**kw, reasoning_effort="none").choices[0].message.model_dump()
    assert off["content"] and not off.get("reasoning_content")  # the template closed the block
    on = client.chat.completions.create(**kw, reasoning_effort="high").choices[0].message.model_dump()
    assert on["reasoning_content"] and on["content"] is None
    bad = {"reasoning_effort": "high", "extra_body": {"chat_template_kwargs": {"enable_thinking": False}}}
    with pytest.raises(openai.BadRequestError, match="contradicts"):
        client.chat.completions.create(**kw, **bad)
    with pytest.raises(openai.BadRequestError, match="reasoning_effort must be one of"):
        client.chat.completions.create(**kw, reasoning_effort="extreme")


def test_a_parser_that_does_not_fit_the_template_is_refused_at_start(qwen_dir):
    manifest = manifest_yaml(mode="colocated", model={"source": str(qwen_dir), "max_model_len": 2048},
                             server={"port": 0, "tool_call_parser": "hermes"})  # fmt: skip
    with pytest.raises(RuntimeError, match="use --tool-call-parser qwen3_coder"):
        start_serve(parse_manifest(json.dumps(manifest), "test manifest"), timeout_s=180)


def test_vllms_command_line_starts_and_serves_qwen3_5(qwen_split):
    """`splitserve serve --model MODEL --enable-auto-tool-choice --tool-call-parser qwen3_coder
    --reasoning-parser qwen3`, as vLLM is started for Qwen3.5 (the `qwen_split` deployment, conftest.py):
    it serves a forced call; a bad tool schema is a 400 naming it."""
    client = qwen_split.client(timeout=120)
    kw = {"model": client.models.list().data[0].id, "messages": ASK, "max_tokens": 120,
          "extra_body": {"thinking_token_budget": 2}}  # fmt: skip
    message = client.chat.completions.create(**kw, tools=TOOLS, tool_choice=NAMED).choices[0].message
    (call,) = message.tool_calls
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object",
            "properties": {"x": {"type": "nonsense"}}}}}]  # fmt: skip
    with pytest.raises(openai.BadRequestError, match=r"tools\[0\]\.function\.parameters") as err:
        client.chat.completions.create(**kw, tools=bad, tool_choice="required")
    assert err.value.body["param"] == "tools[0].function.parameters"


def test_responses_give_reasoning_items(qwen_served):
    client = qwen_served.client(timeout=120)
    kw = {
        "model": client.models.list().data[0].id,
        "input": "Weather?",
        "temperature": 0,
        "max_output_tokens": 12,
    }
    whole = client.responses.create(**kw).model_dump()
    (item,) = [i for i in whole["output"] if i["type"] == "reasoning"]
    text = item["content"][0]["text"]
    assert text and item["content"][0]["type"] == "reasoning_text"
    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response.model_dump()
    streamed = [i for i in final["output"] if i["type"] == "reasoning"]
    assert deltas == text and streamed[0]["content"][0]["text"] == text
