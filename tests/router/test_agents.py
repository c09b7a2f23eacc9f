"""What agents do, against the real default model (SmolLM2-135M-Instruct) served colocated: a tool
conversation end to end through the `openai` SDK (call, tool result, final answer), the SDK's
`chat.completions.parse` with a pydantic model, and LangChain's `with_structured_output` and `bind_tools`."""

from __future__ import annotations

import json

import pytest
from pydantic import BaseModel, Field
from serve_harness import MODEL, check_schema, sse_events

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather in a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "maxLength": 20},
                "unit": {"enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
        },
    },
}


class City(BaseModel):
    name: str = Field(max_length=30)
    country: str = Field(max_length=30)
    population_millions: int = Field(ge=0, le=100)


def test_tool_conversation_end_to_end(colocated):
    """The model calls the tool (required: the grammar makes the call parse), gets its result back in the
    history, and answers in text."""
    client = colocated.client(timeout=120)
    messages = [{"role": "user", "content": "What is the weather in Paris right now?"}]
    r = client.chat.completions.create(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_tokens=60,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.function.name == "get_weather" and call.id.startswith("call_")
    args = json.loads(call.function.arguments)
    assert set(args) == {"city", "unit"} and args["unit"] in ("celsius", "fahrenheit")
    messages += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21, "sky": "sunny"})},
    ]
    final = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER], tool_choice="none", temperature=0, max_tokens=40
    )
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls
    assert answer.finish_reason in ("stop", "length")


def test_streamed_tool_call_deltas(colocated):
    """Streamed: the role first, the call as OpenAI streams one (index, id, type, name, arguments), then
    finish_reason tool_calls."""
    client = colocated.client(timeout=120)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Weather in Oslo?"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "get_weather"}},
            temperature=0,
            max_tokens=60,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert deltas[0].role == "assistant"
    calls = [tc for d in deltas for tc in d.tool_calls or []]
    assert calls and calls[0].index == 0 and calls[0].id and calls[0].function.name == "get_weather"
    args = json.loads("".join(tc.function.arguments or "" for tc in calls))
    assert args["unit"] in ("celsius", "fahrenheit")
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_sdk_parse_returns_a_parsed_object(colocated):
    client = colocated.client(timeout=120)
    r = client.chat.completions.parse(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe Paris as JSON."}],
        response_format=City,
        temperature=0,
        max_tokens=80,
    )
    parsed = r.choices[0].message.parsed
    assert isinstance(parsed, City), r.choices[0].message.content


def _chat_openai(url: str, **kw):
    """LangChain's OpenAI chat model against the deployment, greedy."""
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=f"{url}/v1", api_key="unused", temperature=0, max_tokens=80,
                      max_retries=0, timeout=120, **kw)  # fmt: skip


def test_langchain_structured_output_and_tools(colocated):
    pytest.importorskip("langchain_openai")
    from langchain_core.messages import AIMessage
    from langchain_core.tools import tool

    llm = _chat_openai(colocated.url)
    city = llm.with_structured_output(City).invoke("Describe Paris.")
    assert isinstance(city, City)

    @tool
    def get_weather(city: str) -> str:
        """Get the current weather in a city."""
        return "sunny"

    msg = llm.bind_tools([get_weather], tool_choice="get_weather").invoke("What is the weather in Lima?")
    assert isinstance(msg, AIMessage) and msg.tool_calls, msg
    assert msg.tool_calls[0]["name"] == "get_weather" and isinstance(msg.tool_calls[0]["args"]["city"], str)


RESPONSES_TOOL = {"type": "function", **WEATHER["function"]}


def test_responses_api_text_and_function_tools(colocated):
    """`client.responses.create`: text (streamed and not), then a forced function call, its output fed
    back as input items, and a text answer."""
    client = colocated.client(timeout=120)
    r = client.responses.create(model=MODEL, input="Say hello.", max_output_tokens=16, temperature=0)
    assert r.object == "response" and r.status in ("completed", "incomplete") and r.output_text
    events = list(
        client.responses.create(
            model=MODEL, input="Say hello.", max_output_tokens=16, temperature=0, stream=True
        )
    )
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"]
    assert kinds[-1] in ("response.completed", "response.incomplete")
    streamed = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert streamed == r.output_text  # greedy: the same text either way
    r = client.responses.create(
        model=MODEL,
        input="Weather in Paris?",
        tools=[RESPONSES_TOOL],
        tool_choice="required",
        parallel_tool_calls=False,
        temperature=0,
        max_output_tokens=60,
    )
    (call,) = [o for o in r.output if o.type == "function_call"]
    assert call.name == "get_weather" and set(json.loads(call.arguments)) == {"city", "unit"}
    follow = [
        {"role": "user", "content": "Weather in Paris?"},
        call.model_dump(exclude_none=True),
        {"type": "function_call_output", "call_id": call.call_id, "output": "sunny, 21 C"},
    ]
    r = client.responses.create(
        model=MODEL,
        input=follow,
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        temperature=0,
        max_output_tokens=30,
    )
    assert r.output_text and not [o for o in r.output if o.type == "function_call"]


def test_instructor_responses_tools_mode(colocated):
    """instructor's RESPONSES_TOOLS mode: /v1/responses with a named function tool_choice (and the
    model's schema as its parameters); the forced call's arguments parse into the pydantic model."""
    instructor = pytest.importorskip("instructor")
    client = instructor.from_openai(colocated.client(timeout=120), mode=instructor.Mode.RESPONSES_TOOLS)
    city = client.responses.create(
        model=MODEL,
        input="Name a large city, its country and population in millions.",
        response_model=City,
        max_retries=0,
        temperature=0,
        max_output_tokens=80,
    )
    assert isinstance(city, City) and city.name and city.country


def test_langchain_responses_api(colocated):
    pytest.importorskip("langchain_openai")

    llm = _chat_openai(colocated.url, use_responses_api=True)
    assert llm.invoke("Say hello.").text
    tools = llm.bind_tools([RESPONSES_TOOL], tool_choice="required", parallel_tool_calls=False)
    msg = tools.invoke("Weather in Lima?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"


def test_utility_routes(colocated):
    import httpx

    url = colocated.url
    ids = httpx.post(f"{url}/tokenize", json={"model": MODEL, "prompt": "Hello world"}).json()
    assert ids["count"] == len(ids["tokens"]) > 0 and ids["max_model_len"] == 2048
    assert httpx.post(f"{url}/detokenize", json={"model": MODEL, "tokens": ids["tokens"]}).json() == {
        "prompt": "Hello world"
    }
    chat = httpx.post(
        f"{url}/tokenize", json={"messages": [{"role": "user", "content": "Hi"}], "return_token_strs": True}
    ).json()
    assert "<|im_start|>" in chat["token_strs"]
    assert httpx.get(f"{url}/version").json()["version"]
    assert httpx.get(f"{url}/ping").status_code == 200 and httpx.post(f"{url}/ping").status_code == 200
    bad = httpx.post(f"{url}/detokenize", json={"tokens": [-1]})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "tokens"


def test_bodies_validate_against_openai_schema(colocated, openai_schema):
    """A tool-call answer and its stream's chunks validate against OpenAI's own schema; so does a
    /v1/responses object and its stream's events, where the full schema file is at hand."""
    import httpx

    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": "Weather in Oslo?"}],
        "tools": [WEATHER],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 60,
    }
    url = colocated.url
    r = httpx.post(f"{url}/v1/chat/completions", json=body, timeout=120)
    check_schema(openai_schema, "CreateChatCompletionResponse", r.json())
    assert r.json()["choices"][0]["message"]["tool_calls"]
    raw = httpx.post(f"{url}/v1/chat/completions", json={**body, "stream": True}, timeout=120).text
    for event in sse_events(raw)[:-1]:
        check_schema(openai_schema, "CreateChatCompletionStreamResponse", json.loads(event))
    if "Response" not in openai_schema["components"]["schemas"]:
        return  # the extracted components (tests/data) stop at the chat and completions APIs
    rbody = {
        "model": MODEL,
        "input": "Weather in Oslo?",
        "tools": [RESPONSES_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_output_tokens": 60,
    }
    check_schema(openai_schema, "Response", httpx.post(f"{url}/v1/responses", json=rbody, timeout=120).json())
    raw = httpx.post(f"{url}/v1/responses", json={**rbody, "stream": True}, timeout=120).text
    for event in sse_events(raw):
        check_schema(openai_schema, "ResponseStreamEvent", json.loads(event))
