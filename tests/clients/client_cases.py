"""The client matrix's cases: what users of a vLLM endpoint run through their client libraries, one
function per case, run by tests/clients/test_client_matrix.py in one process per client library:

    python tests/clients/client_cases.py CASE [CASE ...]    # SS_BASE_URL (…/v1), SS_API_KEY, SS_MODEL set

A case raises (an assert, or the client's own error) when the served answer is not what the client
needs; it prints one line of what it got. Budgets are large enough for the tiny default model, and
string fields are bounded so that grammar-constrained answers end.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import traceback
from collections.abc import Callable
from typing import Annotated

from pydantic import BaseModel, Field

BASE, KEY, MODEL = os.environ["SS_BASE_URL"], os.environ["SS_API_KEY"], os.environ["SS_MODEL"]
ASK = "Name a city in France."
CASES: dict[str, Callable[[], object]] = {}
RESULT = "client-case: "  # the prefix of a case's outcome line


class City(BaseModel):
    name: str = Field(max_length=20)
    country: str = Field(max_length=20)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the weather in a city",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "properties": {"city": {"type": "string", "maxLength": 20}},
        },  # fmt: skip
    },
}


def case(fn: Callable[[], object]) -> Callable[[], object]:
    CASES[fn.__name__] = fn
    return fn


def _openai():
    import openai

    return openai.OpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)


# ---- openai ----------------------------------------------------------------------------------------


@case
def openai_chat() -> object:
    r = _openai().chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                          max_tokens=32, temperature=0)  # fmt: skip
    assert r.choices[0].message.content and r.usage.completion_tokens > 0
    return r.choices[0].message.content


@case
def openai_chat_stream() -> object:
    stream = _openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": ASK}], max_tokens=32, stream=True,
        stream_options={"include_usage": True},
    )  # fmt: skip
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text and chunks[-1].usage is not None and chunks[-1].usage.completion_tokens > 0
    return text


@case
def openai_completions() -> object:
    r = _openai().completions.create(model=MODEL, prompt="The capital of France is", max_tokens=8)
    assert r.choices[0].text
    return r.choices[0].text


@case
def openai_tools_required() -> object:
    r = _openai().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Weather in Paris?"}], tools=[WEATHER],
        tool_choice="required", max_tokens=64,
    )  # fmt: skip
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and "city" in json.loads(call.function.arguments)
    return call.function.arguments


@case
def openai_parse() -> object:
    r = _openai().chat.completions.parse(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                         response_format=City, max_tokens=96)  # fmt: skip
    city = r.choices[0].message.parsed
    assert isinstance(city, City)
    return city


@case
def openai_responses() -> object:
    r = _openai().responses.create(model=MODEL, input=ASK, max_output_tokens=32)
    assert r.output_text and r.id.startswith("resp_")
    return r.output_text


@case
def openai_responses_stream() -> object:
    events = list(_openai().responses.create(model=MODEL, input=ASK, max_output_tokens=32, stream=True))
    assert events[-1].type == "response.completed", events[-1]
    return "".join(e.delta for e in events if e.type == "response.output_text.delta")


@case
def openai_models() -> object:
    ids = [m.id for m in _openai().models.list()]
    assert MODEL in ids
    return ids


# ---- langchain-openai ------------------------------------------------------------------------------


def _chat_model(**kw):
    from langchain_openai import ChatOpenAI

    return ChatOpenAI(model=MODEL, base_url=BASE, api_key=KEY, max_retries=0, timeout=120, **kw)


@case
def langchain_invoke() -> object:
    msg = _chat_model(max_tokens=32).invoke(ASK)
    assert msg.content
    return msg.content


@case
def langchain_stream() -> object:
    text = "".join(chunk.content for chunk in _chat_model(max_tokens=32).stream(ASK))
    assert text
    return text


@case
def langchain_structured_output() -> object:
    city = _chat_model(max_tokens=96).with_structured_output(City, method="json_schema").invoke(ASK)
    assert isinstance(city, City)
    return city


@case
def langchain_bind_tools() -> object:
    msg = _chat_model(max_tokens=64).bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather?")
    assert msg.tool_calls and msg.tool_calls[0]["name"] == "get_weather"
    return msg.tool_calls


@case
def langchain_responses_api() -> object:
    msg = _chat_model(max_tokens=32, use_responses_api=True).invoke(ASK)
    assert msg.text
    return msg.text


# ---- openai-agents ---------------------------------------------------------------------------------


def _agents_run(api: str, **agent_kw) -> object:
    import openai
    from agents import (
        Agent,
        ModelSettings,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        set_tracing_disabled,
    )

    set_tracing_disabled(True)  # traces would go to OpenAI's servers
    client = openai.AsyncOpenAI(base_url=BASE, api_key=KEY, max_retries=0, timeout=120)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    settings = agent_kw.pop("model_settings", ModelSettings(max_tokens=96))
    model = kind(model=MODEL, openai_client=client)
    agent = Agent(
        name="helper", instructions="Answer briefly.", model=model, model_settings=settings, **agent_kw
    )
    return Runner.run_sync(agent, ASK, max_turns=3).final_output


@case
def agents_chat() -> object:
    out = _agents_run("chat")
    assert isinstance(out, str) and out
    return out


@case
def agents_responses() -> object:
    out = _agents_run("responses")
    assert isinstance(out, str) and out
    return out


@case
def agents_output_type() -> object:
    out = _agents_run("chat", output_type=City)
    assert isinstance(out, City)
    return out


@case
def agents_tool() -> object:
    from agents import ModelSettings, function_tool

    @function_tool
    def get_weather(city: Annotated[str, Field(max_length=20)]) -> str:
        """Get the weather in a city."""
        return f"sunny in {city}"

    out = _agents_run("chat", tools=[get_weather], tool_use_behavior="stop_on_first_tool",
                      model_settings=ModelSettings(max_tokens=64, tool_choice="required"))  # fmt: skip
    assert isinstance(out, str) and out.startswith("sunny in"), out
    return out


# ---- pydantic-ai -----------------------------------------------------------------------------------


def _pai_agent(**kw):
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    model = OpenAIChatModel(MODEL, provider=OpenAIProvider(base_url=BASE, api_key=KEY))
    return Agent(model, model_settings={"max_tokens": 96, "timeout": 120}, **kw)


@case
def pydantic_ai_text() -> object:
    out = _pai_agent().run_sync(ASK).output
    assert isinstance(out, str) and out
    return out


@case
def pydantic_ai_output_type() -> object:
    out = _pai_agent(output_type=City).run_sync(ASK).output
    assert isinstance(out, City)
    return out


@case
def pydantic_ai_stream() -> object:
    async def run() -> str:
        async with _pai_agent().run_stream(ASK) as result:
            return "".join([text async for text in result.stream_text(delta=True)])

    out = asyncio.run(run())
    assert out
    return out


# ---- litellm ---------------------------------------------------------------------------------------


def _litellm(**kw):
    import litellm

    return litellm.completion(model=f"openai/{MODEL}", api_base=BASE, api_key=KEY, timeout=120,
                              messages=[{"role": "user", "content": ASK}], **kw)  # fmt: skip


@case
def litellm_completion() -> object:
    r = _litellm(max_tokens=32)
    assert r.choices[0].message.content
    return r.choices[0].message.content


@case
def litellm_stream() -> object:
    text = "".join(c.choices[0].delta.content or "" for c in _litellm(max_tokens=32, stream=True))
    assert text
    return text


@case
def litellm_tools() -> object:
    r = _litellm(max_tokens=64, tools=[WEATHER], tool_choice="required")
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_weather"
    return call.function.arguments


@case
def litellm_response_format() -> object:
    r = _litellm(max_tokens=96, response_format=City)
    return City.model_validate_json(r.choices[0].message.content)


# ---- instructor ------------------------------------------------------------------------------------


def _instructor(mode_name: str) -> object:
    import instructor

    client = instructor.from_openai(_openai(), mode=getattr(instructor.Mode, mode_name))
    if mode_name.startswith("RESPONSES"):
        city = client.responses.create(model=MODEL, input=ASK, response_model=City, max_output_tokens=96,
                                       max_retries=0)  # fmt: skip
    else:
        city = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": ASK}],
                                              response_model=City, max_tokens=96, max_retries=0)  # fmt: skip
    assert isinstance(city, City)
    return city


# JSON mode (json_object, the schema only in the prompt) is left out: nothing holds the answer to the
# schema there, and the tiny model writes JSON past any budget
for _mode in ("TOOLS", "TOOLS_STRICT", "JSON_SCHEMA", "RESPONSES_TOOLS"):
    CASES[f"instructor_{_mode.lower()}"] = lambda m=_mode: _instructor(m)


if __name__ == "__main__":
    # one or more cases of one client library, in order: each case's outcome is a JSON line (the case,
    # whether it passed, what it got or its traceback), and a failing case does not stop the next
    for name in sys.argv[1:]:
        try:
            line = {"case": name, "ok": True, "got": repr(CASES[name]())[:400]}
        except BaseException:  # noqa: BLE001 - the case's failure is the test's to report
            line = {"case": name, "ok": False, "error": traceback.format_exc()[-4000:]}
        print(RESULT + json.dumps(line), flush=True)
