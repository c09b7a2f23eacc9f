"""Structured outputs and forced tool calls through real deployments of a random-weight tiny model (its
free text is noise, so only the grammar makes an answer parse): colocated and disaggregated, streamed and
not, over the official `openai` SDK. Also: bad grammars are 400s, an unsatisfiable one ends by length,
and the pools are full afterwards.

Costly grammars contained, through the disaggregated deployment (its `server.structured` limits set): a
100,000-value enum, a 100,000-entry guided_choice, a nested quantifier and a million-fold repetition are
each a 400 naming its limit, answered at the router, while two plain streams run beside them and finish;
constrained requests after them answer. A grammar within the limits that does not compile by
`compile_timeout_s` is a 503, its request holds nothing afterwards, and the bystanders are untouched.
(Their latency beside it, against a trivially refused request: bench/grammar_flood.py.)"""

from __future__ import annotations

import asyncio
import json

import jsonschema
import openai
import pytest
from serve_harness import manifest_yaml, start_deployment

MODEL = "random:tiny-chat"
SCHEMAS = [
    {  # nesting, enums, arrays, required
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 6},
            "kind": {"enum": ["cat", "dog", "fish"]},
            "owner": {
                "type": "object",
                "properties": {
                    "age": {"type": "integer", "minimum": 0, "maximum": 120},
                    "vip": {"type": "boolean"},
                },
                "required": ["age", "vip"],
            },
            "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
        },
        "required": ["name", "kind", "owner", "tags"],
    },
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 4,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "score": {"type": "integer", "minimum": 0, "maximum": 9},
            "level": {"enum": ["low", "mid", "high"]},
        },
        "required": ["ok", "score", "level"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "maxItems": 2,
                "items": {
                    "type": "object",
                    "properties": {
                        "id": {"type": "integer", "minimum": 1, "maximum": 99},
                        "label": {"type": "string", "maxLength": 4},
                    },
                    "required": ["id", "label"],
                },
            }
        },
        "required": ["items"],
    },
]
CITY, UNIT = {"enum": ["Paris", "Oslo", "Lima"]}, {"enum": ["c", "f"]}
INT = {"type": "integer", "minimum": 0, "maximum": 999}
WEATHER = {"type": "object", "properties": {"city": CITY, "unit": UNIT}, "required": ["city", "unit"]}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                      "parameters": WEATHER}},
    {"type": "function", "function": {"name": "add", "description": "Add two integers",
                                      "parameters": {"type": "object", "properties": {"a": INT, "b": INT},
                                                     "required": ["a", "b"]}}},
]  # fmt: skip
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
MESSAGES = [{"role": "user", "content": "Give me the answer."}]


# the limits' tests' deadline: well past the milliseconds the grammars above take to compile
STRUCTURED = {"max_enum_values": 40_000, "max_schema_bytes": 1 << 20, "compile_timeout_s": 1.0}


def _start(mode: str, server: dict | None = None):
    model = {"source": MODEL, "max_model_len": 512}
    engine = {"kv_cache_mb": 16, "max_num_seqs": 32}
    return start_deployment(manifest_yaml(mode=mode, model=model, engine=engine, server=server or {}))


@pytest.fixture(scope="module")
def split():
    """The disaggregated deployment, with the limits' tests' `server.structured` limits."""
    d = _start("disaggregated", {"port": 0, "structured": STRUCTURED})
    yield d
    assert d.stop() == 0, "\n".join(d.log)


@pytest.fixture(scope="module", params=["colocated", "disaggregated"])
def dep(request):
    if request.param == "disaggregated":
        yield request.getfixturevalue("split")
        return
    d = _start("colocated")
    yield d
    assert d.stop() == 0, "\n".join(d.log)


async def _answer(client: openai.AsyncOpenAI, stream: bool, **kw) -> tuple[str, str | None, list]:
    """-> (content, finish_reason, tool calls as [(name, arguments)]), streamed or not."""
    if not stream:
        r = await client.chat.completions.create(model=MODEL, messages=MESSAGES, **kw)
        msg = r.choices[0].message
        calls = [(c.function.name, c.function.arguments) for c in msg.tool_calls or []]
        return msg.content or "", r.choices[0].finish_reason, calls
    text, reason, calls = "", None, {}
    async for chunk in await client.chat.completions.create(
        model=MODEL, messages=MESSAGES, stream=True, **kw
    ):
        for ch in chunk.choices:
            text += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                name, args = calls.get(tc.index, ("", ""))
                calls[tc.index] = (name + (tc.function.name or ""), args + (tc.function.arguments or ""))
            reason = ch.finish_reason or reason
    return text, reason, [calls[i] for i in sorted(calls)]


def test_json_schema_answers_validate(dep):
    """100 seeded json_schema requests (4 schemas x 25 seeds), half streamed: every answer validates."""
    client = dep.async_client(timeout=300)

    async def one(i: int) -> tuple[int, str, str | None]:
        schema = SCHEMAS[i % len(SCHEMAS)]
        fmt = {"type": "json_schema", "json_schema": {"name": f"s{i % 4}", "schema": schema, "strict": True}}
        text, reason, _ = await _answer(
            client, i % 2 == 1, response_format=fmt, max_tokens=160, seed=i, temperature=1.0
        )
        return i, text, reason

    async def main():
        return await asyncio.gather(*(one(i) for i in range(100)))

    bad = []
    for i, text, reason in asyncio.run(main()):
        try:
            jsonschema.validate(json.loads(text), SCHEMAS[i % len(SCHEMAS)])
            assert reason == "stop"
        except (ValueError, AssertionError, jsonschema.ValidationError) as exc:
            bad.append((i, reason, text[:120], str(exc)[:80]))
    assert not bad, bad
    stats = dep.wait_idle()
    assert all(s["blocks"]["free"] == s["blocks"]["total"] for s in stats.values()), stats


def test_forced_tool_calls_validate(dep):
    """tool_choice required (parallel or not) and a named function: always a call whose arguments
    validate against the tool's parameters, finish_reason tool_calls (or length, amid parallel calls)."""
    client = dep.async_client(timeout=300)
    named = {"type": "function", "function": {"name": "add"}}
    cases = [
        (choice, parallel, stream)
        for choice in ("required", named)
        for parallel in (True, False)
        for stream in (False, True)
    ]

    async def one(i: int):
        choice, parallel, stream = cases[i % len(cases)]
        out = await _answer(
            client,
            stream,
            tools=TOOLS,
            tool_choice=choice,
            parallel_tool_calls=parallel,
            max_tokens=120,
            seed=i,
        )
        return choice, parallel, out

    async def main():
        return await asyncio.gather(*(one(i) for i in range(16)))

    for choice, parallel, (_, reason, calls) in asyncio.run(main()):
        assert calls, (choice, reason)
        # parallel calls: the model decides how many, so max_tokens may end them ("length")
        assert reason == "tool_calls" or (parallel and choice == "required" and reason == "length")
        assert parallel or len(calls) == 1
        for name, args in calls:
            assert choice == "required" or name == "add"
            jsonschema.validate(json.loads(args), PARAMS[name])


def test_a_forced_call_with_a_response_format_is_served(dep):
    """tool_choice named or required together with response_format json_schema (legal in OpenAI's API):
    the forced call is the answer, its arguments follow the tool's parameters; the format, which shapes
    content, has none to shape. Chat (streamed and not) and /v1/responses with text.format."""
    client = dep.async_client(timeout=300)
    fmt = {"type": "json_schema", "json_schema": {"name": "s", "schema": SCHEMAS[0], "strict": True}}
    named = {"type": "function", "function": {"name": "add"}}

    tool = {"type": "function", **TOOLS[1]["function"]}
    text = {"format": {"type": "json_schema", "name": "s", "schema": SCHEMAS[0], "strict": True}}

    async def main():
        cases = [(named, False), (named, True), ("required", False)]
        jobs = [_answer(client, stream, tools=TOOLS, tool_choice=choice, parallel_tool_calls=False,
                        response_format=fmt, max_tokens=120, seed=i)
                for i, (choice, stream) in enumerate(cases)]  # fmt: skip
        r = await client.responses.create(model=MODEL, input="Give me the answer.", tools=[tool],
                                          tool_choice={"type": "function", "name": "add"}, text=text,
                                          max_output_tokens=120)  # fmt: skip
        return await asyncio.gather(*jobs), r

    chats, r = asyncio.run(main())
    for i, (content, reason, calls) in enumerate(chats):
        assert reason == "tool_calls" and len(calls) == 1 and not content.strip(), (i, reason, content)
        name, args = calls[0]
        assert i == 2 or name == "add"
        jsonschema.validate(json.loads(args), PARAMS[name])
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "add"
    jsonschema.validate(json.loads(call.arguments), PARAMS["add"])


def test_vllm_guided_fields(dep):
    client = dep.client()
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 20, "seed": 3}
    r = client.chat.completions.create(**kw, extra_body={"guided_choice": ["yes", "no"]})
    assert r.choices[0].message.content in ("yes", "no")
    r = client.chat.completions.create(
        **kw, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]{2}"}}
    )
    assert len(r.choices[0].message.content) == 6 and r.choices[0].message.content[3] == "-"
    r = client.completions.create(
        model=MODEL, prompt="x", max_tokens=60, seed=1, extra_body={"guided_json": SCHEMAS[2]}
    )
    jsonschema.validate(json.loads(r.choices[0].text), SCHEMAS[2])
    r = client.chat.completions.create(**{**kw, "max_tokens": 60}, response_format={"type": "json_object"})
    text = r.choices[0].message.content  # free keys and strings: noise may run past max_tokens
    assert text.startswith("{") and (
        r.choices[0].finish_reason == "length" or isinstance(json.loads(text), dict)
    )


@pytest.mark.parametrize(
    "extra, words",
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "x", "schema": {"type": "nope"}},
                }
            },
            "nope",
        ),
        ({"guided_regex": "(ab"}, "guided_regex"),
        ({"guided_grammar": "root ::= undefined_rule"}, "undefined_rule"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["b"]}, "one structured output"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        (
            {
                "tools": [{"type": "function", "function": {"name": "f"}}],
                "tool_choice": {"type": "function", "function": {"name": "g"}},
            },
            "'g'",
        ),
    ],
)
def test_bad_grammars_are_400s(dep, extra, words):
    with pytest.raises(openai.BadRequestError) as err:
        dep.client().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=5, extra_body=extra)
    assert err.value.status_code == 400 and words in err.value.message, err.value.message


def test_unsatisfiable_grammar_ends_by_length(dep):
    """A grammar that cannot be met within max_tokens ends with `length`, streamed or not; nothing leaks."""
    client = dep.client()
    kw = {"model": MODEL, "messages": MESSAGES, "max_tokens": 6, "extra_body": {"guided_regex": "a{200}"}}
    r = client.chat.completions.create(**kw)
    assert r.choices[0].finish_reason == "length" and set(r.choices[0].message.content) <= {"a"}
    reasons = [
        c.choices[0].finish_reason for c in client.chat.completions.create(**kw, stream=True) if c.choices
    ]
    assert reasons[-1] == "length"
    stats = dep.wait_idle()
    assert all(s["blocks"]["free"] == s["blocks"]["total"] for s in stats.values()), stats


@pytest.fixture(scope="module")
def engine_answers():
    """The in-process engine's answers to seeded constrained requests: what both deployments must give."""
    from splitserve import LLM, SamplingParams
    from splitserve.sampling.params import GrammarSpec

    llm = LLM(model=MODEL, max_model_len=512, kv_cache_bytes=16 << 20, progress=False)
    prompts = [[100 + i, 200, 300 + i] for i in range(8)]
    out = []
    for i, ids in enumerate(prompts):
        spec = GrammarSpec("json", json.dumps(SCHEMAS[i % len(SCHEMAS)]))
        (o,) = llm.generate([{"prompt_token_ids": ids}], SamplingParams(max_tokens=160, seed=i, grammar=spec))
        out.append((ids, o.outputs[0].text))
    return out


def test_constrained_output_equals_the_engine(dep, engine_answers):
    """Seeded json_schema answers over HTTP equal the engine's, token for token, colocated and
    disaggregated alike (the decode worker replays the prefill's first token into its matcher)."""
    client = dep.client()
    for i, (ids, text) in enumerate(engine_answers):
        r = client.completions.create(
            model=MODEL,
            prompt=ids,
            max_tokens=160,
            seed=i,
            extra_body={"guided_json": SCHEMAS[i % len(SCHEMAS)]},
        )
        assert r.choices[0].text == text


HOSTILE = [  # (extra body, the limit named, the field named)
    ({"guided_json": {"enum": [f"v{i}" for i in range(100_000)]}}, "max_enum_values", "guided_json"),
    ({"guided_choice": [f"c{i}" for i in range(100_000)]}, "max_choices", "guided_choice"),
    ({"guided_regex": "^(a+)+$"}, "allow_nested_quantifiers", "guided_regex"),
    ({"guided_regex": "^a{1000000}$"}, "max_repetition", "guided_regex"),
]
# within the limits below, and slower to compile than the deadline (a 30,000-value enum: seconds)
SLOW = {"guided_json": {"enum": [f"slow{i}" for i in range(30_000)]}}


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


def test_costly_grammars_are_400s_beside_bystanders(split):
    client = split.async_client(timeout=5.0)  # each answer within 5 s, or the client raises

    async def main():
        bystanders = [asyncio.create_task(_bystander(split.async_client(timeout=120), s)) for s in (1, 2)]
        refusals = await asyncio.gather(*(_refusal(client, extra) for extra, _, _ in HOSTILE))
        return refusals, await asyncio.gather(*bystanders)

    refusals, reasons = asyncio.run(main())
    for err, (_, limit, field) in zip(refusals, HOSTILE, strict=True):
        assert err is not None and err.status_code == 400, (limit, err)
        assert (
            limit in err.message and err.body["param"] == field and err.body["code"] == "grammar_too_complex"
        )
    assert reasons == ["length", "length"]
    _constrained_requests_answer(split)


def test_a_compile_past_its_deadline_is_a_503_and_holds_nothing(split):
    async def main():
        bystander = asyncio.create_task(_bystander(split.async_client(timeout=120), 3))
        err = await _refusal(split.async_client(timeout=10.0), SLOW)
        return err, await bystander

    err, reason = asyncio.run(main())
    assert err is not None and err.status_code == 503 and "compile" in err.message, err
    assert reason == "length"
    _constrained_requests_answer(split)
    stats = split.wait_idle(60)
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
