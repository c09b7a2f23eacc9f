"""Qwen3.5's XML tool calls (`qwen3_coder`) on scripted answers, with and without thinking: each parsed
whole and streamed split at every character boundary, the joined deltas equal to the whole parse."""

from __future__ import annotations

import pytest
from parser_streams import args, check_streams, joined

from splitserve.router.parsers import ChatOutput, reasoning_parser, tool_parser

TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "days": {"type": "integer"},
                       "metric": {"type": "boolean"}},
    }}},
    {"type": "function", "function": {"name": "write_file", "parameters": {
        "type": "object",
        "properties": {
            "path": {"type": "string"}, "text": {"type": "string"}, "mode": {"type": ["string", "null"]},
            "tags": {"type": "array", "items": {"type": "string"}}, "meta": {"type": "object"},
            "ratio": {"type": "number"}, "size": {"anyOf": [{"type": "integer"}, {"type": "string"}]},
        },
    }}},
]  # fmt: skip
THINKING_ON = "<|im_start|>assistant\n<think>\n"  # how Qwen3.5's template ends the prompt
THINKING_OFF = "<|im_start|>assistant\n<think>\n\n</think>\n\n"


def call(name: str, **params: str) -> str:
    body = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in params.items())
    return f"<tool_call>\n<function={name}>\n{body}</function>\n</tool_call>"


def output(prompt_tail: str = THINKING_OFF, tools: list | None = TOOLS):
    return lambda: ChatOutput(reasoning_parser("qwen3", prompt_tail), tool_parser("qwen3_coder", tools))


def test_one_call():
    parsed = check_streams(output(), call("get_weather", city="Paris", days="3"))
    assert parsed.content is None and parsed.reasoning is None
    assert args(parsed) == [("get_weather", {"city": "Paris", "days": 3})]
    assert parsed.calls[0].arguments == '{"city": "Paris", "days": 3}'


def test_parallel_calls_with_content_before():
    text = f"I'll check both.\n\n{call('get_weather', city='Paris')}\n{call('get_weather', city='Oslo')}"
    parsed = check_streams(output(), text)
    assert parsed.content == "I'll check both."
    assert args(parsed) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Oslo"})]
    assert parsed.calls[0].id != parsed.calls[1].id


def test_calls_after_a_think_block():
    text = (
        f"The user wants weather.\nTwo cities.\n</think>\n\n{call('get_weather', city='Rome', metric='true')}"
    )
    parsed = check_streams(output(THINKING_ON), text)
    assert parsed.reasoning == "The user wants weather.\nTwo cities."
    assert parsed.content is None
    assert args(parsed) == [("get_weather", {"city": "Rome", "metric": True})]


def test_a_call_inside_the_think_block_stays_reasoning_and_is_not_run():
    inner = call("get_weather", city="Paris")
    text = f"Maybe I should call\n{inner}\nNo, I know it.\n</think>\n\nIt is sunny in Paris."
    parsed = check_streams(output(THINKING_ON), text)
    assert parsed.calls == []
    assert inner in parsed.reasoning
    assert parsed.content == "It is sunny in Paris."


def test_a_call_inside_an_unclosed_think_block_is_reasoning():
    text = f"Let me call it.\n{call('get_weather', city='Paris')}"  # cut (or stopped) before </think>
    parsed = check_streams(output(THINKING_ON), text)
    assert parsed.calls == [] and parsed.content is None
    assert parsed.reasoning == text


def test_prose_with_a_literal_tool_call_tag_is_content():
    text = "Wrap each call in a <tool_call> tag, like <tool_call>this</tool_call>. Done <tool_call>"
    parsed = check_streams(output(), text)
    assert parsed.calls == [] and parsed.content == text


def test_a_literal_tag_does_not_stall_the_stream():
    text = "Use the <tool_call> tag. " + "More prose. " * 20
    out = output()()
    cut = text.index("<tool_call>") + len("<tool_call> t")
    deltas = [d for ch in text[:cut] for d in out.deltas(ch, False)]
    assert joined(deltas)["content"] == "Use the <tool_call> t"  # sent as soon as 't' rules a call out


def test_multi_line_string_params_lose_one_newline_each_side():
    body = "\n\ndef f():\n    return 1\n\n"
    parsed = check_streams(output(), call("write_file", path="a.py", text=body))
    assert args(parsed) == [("write_file", {"path": "a.py", "text": body})]


def test_typed_params():
    text = call("write_file", path="x", tags='["a", "b"]', meta="{'k': [1, 2], 'ok': True}", ratio="-2.5e1",
                size="12", mode="null")  # fmt: skip
    parsed = check_streams(output(), text)
    expected = {"path": "x", "tags": ["a", "b"], "meta": {"k": [1, 2], "ok": True}, "ratio": -25.0,
                "size": 12, "mode": None}  # fmt: skip
    assert args(parsed) == [("write_file", expected)]


def test_union_falls_back_to_string_and_mismatches_stay_text():
    parsed = check_streams(output(), call("write_file", size="big", ratio="lots", mode="w"))
    assert args(parsed) == [("write_file", {"size": "big", "ratio": "lots", "mode": "w"})]


def test_an_undeclared_param_stays_a_string():
    parsed = check_streams(output(), call("get_weather", city="Paris", zip="007", extra='{"a": 1}'))
    assert args(parsed) == [("get_weather", {"city": "Paris", "zip": "007", "extra": '{"a": 1}'})]
    unknown = check_streams(output(tools=None), call("lookup", n="5"))
    assert args(unknown) == [("lookup", {"n": "5"})]


def test_an_unclosed_block_cut_by_max_tokens_keeps_its_closed_params():
    text = f"On it.\n{call('get_weather', city='Paris', days='3')}"
    cut_in_value = text[: text.index("3\n</parameter>")]
    parsed = check_streams(output(), cut_in_value)
    assert parsed.content == "On it."
    assert args(parsed) == [("get_weather", {"city": "Paris"})]
    parsed = check_streams(output(), text[: text.index("</function>")])
    assert args(parsed) == [("get_weather", {"city": "Paris", "days": 3})]
    no_params = check_streams(output(), "<tool_call>\n<function=get_weather>\n<param")
    assert args(no_params) == [("get_weather", {})]


def test_a_block_cut_inside_its_head_is_content():
    parsed = check_streams(output(), "Calling now.\n<tool_call>\n<function=get_wea")
    assert parsed.calls == [] and parsed.content == "Calling now.\n<tool_call>\n<function=get_wea"


ENDINGS = ["\n</function>\n</tool_call>", "\n</function>", "\n</function>\n</tool_call>\n"]


@pytest.mark.parametrize("ending", ENDINGS)
def test_the_last_parameter_in_the_same_delta_as_function_end(ending):
    out = output()()
    deltas = out.deltas("<tool_call>\n<function=get_weather>\n", False)
    deltas += out.deltas(f"<parameter=city>\nParis\n</parameter>{ending}", False)
    deltas += out.deltas("", True)
    assert joined(deltas)["calls"] == [("get_weather", '{"city": "Paris"}')]


def test_content_between_and_after_calls():
    text = f"First.\n{call('get_weather', city='A')}\nThen.\n{call('get_weather', city='B')}\nDone."
    parsed = check_streams(output(), text)
    assert parsed.content == "First.\nThen.\nDone."
    assert len(parsed.calls) == 2


def test_a_string_value_streams_before_its_end_tag():
    out = output()()
    text = call("write_file", path="a.txt", text="line one\nline two")
    cut = text.index("two") + 2
    sent = joined([d for ch in text[:cut] for d in out.deltas(ch, False)])
    assert sent["calls"] == [("write_file", '{"path": "a.txt", "text": "line one\\nline tw')]


def test_a_string_value_cut_short_keeps_what_came():
    text = call("write_file", path="a.txt", text="partial body")
    parsed = check_streams(output(), text[: text.index(" body")])
    assert args(parsed) == [("write_file", {"path": "a.txt", "text": "partial"})]


@pytest.mark.parametrize("raw", ["", "\n", "\n\n"])
def test_empty_string_values(raw):
    text = f"<tool_call>\n<function=write_file>\n<parameter=text>{raw}</parameter>\n</function>\n</tool_call>"
    assert args(check_streams(output(), text)) == [("write_file", {"text": ""})]


def test_a_forced_call_is_held_to_the_xml_format_and_the_schema():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    from splitserve.router.tools import tool_grammar

    grammar = xgr.Grammar.from_structural_tag(tool_grammar(TOOLS[:1], "required", False, "qwen3_coder"))
    good = call("get_weather", city="Paris", days="3")
    assert accepts(grammar, good)
    assert args(check_streams(output(), good)) == [("get_weather", {"city": "Paris", "days": 3})]
    assert not accepts(grammar, call("get_weather", city="Paris", days="three"))
    assert not accepts(grammar, call("get_weather", city="Paris", zip="1"))  # not declared
    assert not accepts(grammar, '<tool_call>\n{"name": "get_weather", "arguments": {}}\n</tool_call>')


@pytest.mark.parametrize(
    ("raw", "value"), [(" Paris ", "Paris"), ("\r\nParis\n", "\nParis"), ("\n  x\n\n", "  x\n")]
)
def test_one_blank_at_each_end_is_the_formats(raw, value):
    """As the forcing grammar (xgrammar's qwen_xml) reads a value: one blank each side is the format's."""
    text = f"<tool_call>\n<function=write_file>\n<parameter=text>{raw}</parameter>\n</function>\n</tool_call>"
    assert args(check_streams(output(), text)) == [("write_file", {"text": value})]
