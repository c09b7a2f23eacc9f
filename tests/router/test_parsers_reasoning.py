"""Reasoning parsers (`qwen3`, `deepseek_r1`) on scripted answers, alone and in front of the JSON tool-call
parsers; the parsers chosen from a template and the ones refused; the XML parser's value types. Each
answer parsed whole and streamed split at every character boundary."""

from __future__ import annotations

import pytest
from parser_streams import args, check_streams

from splitserve.router.parsers import (
    ChatOutput,
    check_reasoning_parser,
    check_tool_parser,
    reasoning_parser,
    reasoning_parser_for_template,
    tool_parser,
    tool_parser_for_template,
)
from splitserve.router.parsers.xml_values import convert, declared_types

QWEN_ON, QWEN_OFF = "assistant\n<think>\n", "assistant\n<think>\n\n</think>\n\n"
R1 = "<｜Assistant｜>"
HERMES_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'


def thinking(kind: str, prompt_tail: str, tools: str | None = None):
    return lambda: ChatOutput(reasoning_parser(kind, prompt_tail), tool_parser(tools) if tools else None)


@pytest.mark.parametrize(
    ("kind", "tail", "text", "reasoning", "content"),
    [
        ("qwen3", QWEN_ON, "Think.\nMore.\n</think>\n\nThe answer.", "Think.\nMore.", "The answer."),
        ("qwen3", QWEN_OFF, "The answer.", None, "The answer."),
        ("qwen3", "assistant\n", "<think>\nSelf-opened.\n</think>\n\nHi", "Self-opened.", "Hi"),
        ("qwen3", "assistant\n", "No block <think> here", None, "No block <think> here"),
        ("qwen3", QWEN_ON, "Cut by max_tokens while thi", "Cut by max_tokens while thi", None),
        ("qwen3", QWEN_ON, "\n</think>\n\nEmpty thinking.", None, "Empty thinking."),
        ("deepseek_r1", R1 + "<think>\n", "R1 thinks.</think>Answer.", "R1 thinks.", "Answer."),
        ("deepseek_r1", R1, "<think>Opened again.</think>\nAnswer.", "Opened again.", "Answer."),
        ("deepseek_r1", R1, "Only thinking, never closed", "Only thinking, never closed", None),
    ],
)
def test_reasoning_apart_from_content(kind, tail, text, reasoning, content):
    parsed = check_streams(thinking(kind, tail), text)
    assert (parsed.reasoning, parsed.content) == (reasoning, content)


def test_hermes_calls_after_thinking():
    text = f"I add.\n</think>\n\nSure.\n{HERMES_CALL}\n{HERMES_CALL}"
    parsed = check_streams(thinking("qwen3", QWEN_ON, "hermes"), text)
    assert parsed.reasoning == "I add." and parsed.content == "Sure."
    assert args(parsed) == [("add", {"a": 1, "b": 2})] * 2


def test_a_hermes_call_inside_thinking_is_reasoning():
    text = f"Maybe {HERMES_CALL}\n</think>\n\n3"
    parsed = check_streams(thinking("qwen3", QWEN_ON, "hermes"), text)
    assert parsed.calls == [] and HERMES_CALL in parsed.reasoning and parsed.content == "3"


def test_llama3_json_calls():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1}}; {"name": "add", "parameters": {"a": 2}}'
    parsed = check_streams(lambda: ChatOutput(None, tool_parser("llama3_json")), text)
    assert args(parsed) == [("add", {"a": 1}), ("add", {"a": 2})]


def test_parsers_from_the_template(qwen3_5_template):
    assert tool_parser_for_template(qwen3_5_template) == "qwen3_coder"
    assert reasoning_parser_for_template(qwen3_5_template) == "qwen3"
    assert check_tool_parser("qwen3_xml", qwen3_5_template) == "qwen3_coder"
    assert check_reasoning_parser("qwen3", qwen3_5_template) == "qwen3"
    plain = "{% for m in messages %}{{ m.content }}{% endfor %}"
    assert (tool_parser_for_template(plain), reasoning_parser_for_template(plain)) == ("hermes", None)


def test_a_parser_that_does_not_fit_is_refused_with_the_right_name(qwen3_5_template):
    with pytest.raises(ValueError, match="use --tool-call-parser qwen3_coder"):
        check_tool_parser("hermes", qwen3_5_template)
    with pytest.raises(ValueError, match="use --tool-call-parser hermes"):
        check_tool_parser("qwen3_coder", "{{ messages }}")
    with pytest.raises(ValueError, match="use --reasoning-parser qwen3"):
        check_reasoning_parser("deepseek_r1", qwen3_5_template)
    with pytest.raises(ValueError, match="no <think> block"):
        check_reasoning_parser("qwen3", "{{ messages }}")
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'"):
        check_tool_parser("mistral", qwen3_5_template)


@pytest.mark.parametrize(
    ("schema", "text", "value"),
    [
        ({"type": "integer"}, " 42 ", 42),
        ({"type": "integer"}, "3.0", 3),
        ({"type": "integer"}, "3.5", "3.5"),
        ({"type": "number"}, "1e3", 1000.0),
        ({"type": "number"}, "nan", "nan"),
        ({"type": "boolean"}, "False", False),
        ({"type": "null"}, "None", None),
        ({"type": "array"}, "[1, 'a']", [1, "a"]),
        ({"type": "object"}, "{(1, 2): 3}", "{(1, 2): 3}"),
        ({"type": ["integer", "null"]}, "null", None),
        ({"oneOf": [{"type": "boolean"}, {"type": "string"}]}, "yes", "yes"),
        ({"enum": [1, 2, 3]}, "2", 2),
        ({"enum": ["1", "2"]}, "2", "2"),
        ({"description": "no type"}, "7", "7"),
        ({"properties": {"a": {}}}, '{"a": 1}', {"a": 1}),
    ],
)
def test_values_take_their_declared_type(schema, text, value):
    assert convert(text, schema) == value
    assert type(convert(text, schema)) is type(value)


def test_declared_types_in_order():
    assert declared_types({"anyOf": [{"type": "string"}, {"type": ["integer", "null"]}]}) == [
        "string", "integer", "null"]  # fmt: skip


@pytest.fixture(scope="module")
def qwen3_5_template() -> str:
    from pathlib import Path

    return (Path(__file__).parents[1] / "fixtures" / "qwen3_5" / "chat_template.jinja").read_text()
