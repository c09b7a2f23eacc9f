"""Qwen3.5's own chat template (tests/fixtures/qwen3_5, kept verbatim) through the project's rendering
path: the tokenizer carries it as a checkpoint's would, the router's message rendering feeds it tools,
earlier calls and their results; thinking on and off; the parsers read back what it renders."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from splitserve.model.tokenizer import Tokenizer, load_tokenizer
from splitserve.router.openai_protocol import ChatMessage
from splitserve.router.parsers import (
    ChatOutput,
    reasoning_parser,
    reasoning_parser_for_template,
    tool_parser,
    tool_parser_for_template,
)
from splitserve.router.parsers.reasoning import starts_in_reasoning
from splitserve.router.tools import render_messages, template_knows_tools

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen3_5" / "chat_template.jinja").read_text()
TOOLS = [{"type": "function", "function": {
    "name": "get_weather", "description": "Weather of a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
                   "required": ["city"]},
}}]  # fmt: skip
HISTORY = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "Weather in Paris for 3 days?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function", "function": {
        "name": "get_weather", "arguments": json.dumps({"city": "Paris", "days": 3})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
]  # fmt: skip


@pytest.fixture(scope="module")
def qwen_tokenizer(tmp_path_factory) -> Tokenizer:
    """The default model's vocabulary (it has ChatML's tokens) saved with Qwen3.5's template beside it,
    as a checkpoint ships it (tiny random Qwen3.5 checkpoints do the same), and loaded as the server does."""
    folder = tmp_path_factory.mktemp("qwen3_5-tokenizer")
    base = load_tokenizer(None)
    assert base is not None
    base.hf.save_pretrained(str(folder))
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    tok = load_tokenizer(str(folder))
    assert tok is not None and tok.chat_template == TEMPLATE
    return tok


def render(tok: Tokenizer, messages: list[dict], **kwargs) -> str:
    ids = tok.apply_chat_template(messages, add_generation_prompt=True, **kwargs)
    return tok.decode(ids, skip_special_tokens=False)


def native(messages: list[dict]) -> list[dict]:
    """The router's rendering of a request's messages for a template that renders tools itself."""
    assert template_knows_tools(TEMPLATE)
    return render_messages([ChatMessage.model_validate(m) for m in messages], TOOLS, native=True)


def test_the_template_picks_its_parsers():
    assert tool_parser_for_template(TEMPLATE) == "qwen3_coder"
    assert reasoning_parser_for_template(TEMPLATE) == "qwen3"


def test_tools_rendered_and_thinking_opened(qwen_tokenizer):
    text = render(qwen_tokenizer, native(HISTORY[:2]), tools=TOOLS)
    assert text.startswith(
        "<|im_start|>system\n# Tools\n\nYou have access to the following functions:\n\n<tools>\n"
    )
    assert json.dumps(TOOLS[0]) in text  # each tool as JSON, one a line
    assert "<tool_call>\n<function=example_function_name>\n<parameter=example_parameter_1>" in text
    assert "</IMPORTANT>\n\nYou are terse.<|im_end|>\n<|im_start|>user\nWeather in Paris" in text
    assert text.endswith("<|im_start|>assistant\n<think>\n")
    assert starts_in_reasoning("qwen3", text[-40:])


def test_thinking_off_prefills_an_empty_block(qwen_tokenizer):
    text = render(qwen_tokenizer, native(HISTORY[:2]), tools=TOOLS, enable_thinking=False)
    assert text.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert not starts_in_reasoning("qwen3", text[-40:])
    parsed = ChatOutput(reasoning_parser("qwen3", text[-40:]), None).parse("Sunny.")
    assert (parsed.reasoning, parsed.content) == (None, "Sunny.")


def test_earlier_calls_and_results_rendered_as_the_parser_reads_them(qwen_tokenizer):
    text = render(qwen_tokenizer, native(HISTORY), tools=TOOLS)
    block = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n"
             "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>")  # fmt: skip
    assert block in text
    assert "<|im_start|>user\n<tool_response>\nsunny\n</tool_response><|im_end|>\n" in text
    content, calls = tool_parser("qwen3_coder", TOOLS).parse(block)
    assert content is None and [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "days": 3})
    ]


def test_earlier_reasoning_kept_only_after_the_last_user_query(qwen_tokenizer):
    oslo = {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}
    messages = [
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!", "reasoning_content": "A greeting."},
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "reasoning_content": "Need a tool.",
         "tool_calls": [oslo]},
        {"role": "tool", "content": "rain"},
    ]  # fmt: skip
    text = render(qwen_tokenizer, messages, tools=TOOLS)
    assert "A greeting." not in text  # before the last user query: dropped
    assert "<|im_start|>assistant\nHello!<|im_end|>" in text
    assert (
        "<|im_start|>assistant\n<think>\nNeed a tool.\n</think>\n\n<tool_call>\n<function=get_weather>"
        in text
    )
