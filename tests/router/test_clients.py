"""Agent clients nobody here wrote, against the tiny random Qwen3.5 (Qwen3.5's own template: XML tool
calls, thinking on) served disaggregated with vLLM's flags: the `openai` SDK, the OpenAI Agents SDK,
LangChain, pydantic-ai and instructor. Random weights write no meaningful answers, so each forced step
(a call, a typed result) is held by the grammar after a thinking bounded by `thinking_token_budget`, and
what is checked is that each client gets what it parses: calls, arguments valid for the tool, typed
results, reasoning apart."""

from __future__ import annotations

import asyncio
import json

import jsonschema
import pytest
from pydantic import BaseModel, Field

BUDGET = {"thinking_token_budget": 4}
PARAMS = {"type": "object", "additionalProperties": False, "required": ["city"],
          "properties": {"city": {"type": "string", "maxLength": 12}}}  # fmt: skip
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "The weather in a city",
                                            "parameters": PARAMS}}  # fmt: skip


class City(BaseModel):
    name: str = Field(max_length=12)
    population_millions: int = Field(ge=0, le=99)


def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def _model(dep) -> str:
    return dep.client().models.list().data[0].id


def test_openai_sdk_chat_tools_streamed_tools_and_responses(qwen_split):
    client = qwen_split.client(timeout=120)
    model = _model(qwen_split)
    kw = {"model": model, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "tools": [WEATHER],
          "tool_choice": "required", "max_tokens": 120, "temperature": 0.7, "seed": 3,
          "extra_body": BUDGET}  # fmt: skip
    choice = client.chat.completions.create(**kw).choices[0]
    (call,) = choice.message.tool_calls
    assert choice.finish_reason == "tool_calls" and call.function.name == "get_weather"
    jsonschema.validate(json.loads(call.function.arguments), PARAMS)
    assert choice.message.model_dump()["reasoning_content"]
    deltas = [c.choices[0].delta for c in client.chat.completions.create(**kw, stream=True) if c.choices]
    arguments = "".join(tc.function.arguments or "" for d in deltas for tc in d.tool_calls or [])
    assert arguments == call.function.arguments  # the same seed: the same call, streamed
    response = client.responses.create(
        model=model, input="Weather in Oslo?", max_output_tokens=120, temperature=0.7,
        tools=[{"type": "function", **WEATHER["function"]}], tool_choice="required",
        extra_body={**BUDGET, "seed": 3},
    )  # fmt: skip
    kinds = [item.type for item in response.output]
    assert kinds == ["reasoning", "function_call"], kinds
    assert response.output[1].name == "get_weather"
    jsonschema.validate(json.loads(response.output[1].arguments), PARAMS)
    assert response.usage.output_tokens_details.reasoning_tokens == 4 + 4  # the budget and "\n</think>"


def test_openai_agents_sdk_runs_an_agent_with_a_function_tool(qwen_split):
    agents = pytest.importorskip("agents")
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=qwen_split.url + "/v1", api_key="none", max_retries=0, timeout=120)
    agents.set_tracing_disabled(True)
    agent = agents.Agent(
        name="weather",
        instructions="Answer with the weather.",
        tools=[agents.function_tool(get_weather)],
        model=agents.OpenAIChatCompletionsModel(model=_model(qwen_split), openai_client=client),
        model_settings=agents.ModelSettings(
            tool_choice="required", max_tokens=60, temperature=0.7, extra_body=BUDGET
        ),
    )
    result = asyncio.run(agents.Runner.run(agent, "Weather in Oslo?", max_turns=4))
    calls = [i for i in result.new_items if i.type == "tool_call_item"]
    outputs = [i.output for i in result.new_items if i.type == "tool_call_output_item"]
    assert calls and outputs and outputs[0].startswith("sunny in ")  # the tool ran on the model's call
    assert isinstance(result.final_output, str) and result.final_output  # then the model answered


def test_langchain_bind_tools_and_structured_output(qwen_split):
    pytest.importorskip("langchain_openai")
    from langchain_openai import ChatOpenAI

    llm = ChatOpenAI(model=_model(qwen_split), base_url=qwen_split.url + "/v1", api_key="none", max_retries=0,
                     timeout=120, temperature=0.7, max_tokens=120, extra_body=BUDGET)  # fmt: skip
    message = llm.bind_tools([WEATHER], tool_choice="get_weather").invoke("Weather in Oslo?")
    (call,) = message.tool_calls
    assert call["name"] == "get_weather"
    jsonschema.validate(call["args"], PARAMS)
    city = llm.with_structured_output(City, method="json_schema").invoke("A big city?")
    assert isinstance(city, City)


def test_pydantic_ai_a_tool_and_a_typed_result(qwen_split):
    pytest.importorskip("pydantic_ai")
    from pydantic_ai import Agent
    from pydantic_ai.models.openai import OpenAIChatModel
    from pydantic_ai.providers.openai import OpenAIProvider

    provider = OpenAIProvider(base_url=qwen_split.url + "/v1", api_key="none")
    model = OpenAIChatModel(_model(qwen_split), provider=provider)
    settings = {"max_tokens": 120, "temperature": 0.7, "extra_body": BUDGET}
    agent = Agent(model, output_type=City, tools=[get_weather], model_settings=settings)
    result = agent.run_sync("Which city, and how big?")
    assert isinstance(result.output, City)


def test_instructor_gives_a_typed_result(qwen_split):
    instructor = pytest.importorskip("instructor")
    from openai import OpenAI

    raw = OpenAI(base_url=qwen_split.url + "/v1", api_key="none", max_retries=0, timeout=120)
    client = instructor.from_openai(raw, mode=instructor.Mode.TOOLS)
    city = client.chat.completions.create(
        model=_model(qwen_split), response_model=City, max_retries=0, max_tokens=120, temperature=0.7,
        messages=[{"role": "user", "content": "A big city?"}], extra_body=BUDGET,
    )  # fmt: skip
    assert isinstance(city, City)
