"""Tool-call parsing and the structured-output translation, without a server: calls out of whole answers
and out of streams split at every character, per model family; the grammars the router builds."""

from __future__ import annotations

import json

import pytest
from parser_streams import args, check_streams

from splitserve.router.openai_protocol import APIError, ChatCompletionRequest
from splitserve.router.parsers import ChatOutput
from splitserve.router.parsers.base import CallDeltas
from splitserve.router.parsers.json_calls import HERMES, LLAMA3, JsonCallParser, ToolParser
from splitserve.router.structured import requested_grammar
from splitserve.router.tools import chosen_tools, parser_for, tool_grammar
from splitserve.sampling.grammar_check import GrammarError, check_grammar
from splitserve.sampling.params import GrammarSpec, SamplingParams

HERMES_TEXT = (
    'Let me check.<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "add", "arguments": {"a": 1, "b": 2}}\n</tool_call>'
)
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}},
]


def ToolDeltas(fmt: str) -> CallDeltas:  # noqa: N802 - a stream's deltas, as a class would make them
    return CallDeltas(JsonCallParser(fmt))


def test_hermes_whole_and_streamed_at_every_split():
    content, calls = ToolParser(HERMES).parse(HERMES_TEXT)
    assert content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris"}),
        ("add", {"a": 1, "b": 2}),
    ]
    for cut in range(len(HERMES_TEXT)):
        stream = ToolDeltas(HERMES)
        deltas = stream.deltas(HERMES_TEXT[:cut], False) + stream.deltas(HERMES_TEXT[cut:], True)
        text = "".join(d.get("content", "") for d in deltas)
        got = _joined([d["tool_calls"][0] for d in deltas if "tool_calls" in d])
        assert text == "Let me check." and sorted(got) == [0, 1], cut
        assert [got[i]["function"] for i in (0, 1)] == [
            {"name": c.name, "arguments": c.arguments} for c in calls
        ], cut
        assert got[1]["function"] == {"name": "add", "arguments": '{"a": 1, "b": 2}'}


def _joined(pieces: list[dict]) -> dict[int, dict]:
    """Streamed tool-call deltas joined as a client joins them: by index, the first with id, type and
    name, the arguments concatenated."""
    calls: dict[int, dict] = {}
    for p in pieces:
        if p["index"] not in calls:
            assert p["id"] and p["type"] == "function" and p["function"]["name"], p
            calls[p["index"]] = {"id": p["id"], "function": {"name": p["function"]["name"], "arguments": ""}}
        else:
            assert "id" not in p and "name" not in p["function"], p
        calls[p["index"]]["function"]["arguments"] += p["function"]["arguments"]
    return calls


def test_hermes_arguments_stream_in_fragments_token_by_token():
    """Fed a few characters at a time, a call is announced once its name is whole and its arguments
    arrive in several fragments before the block closes, never the closing brace of the call."""
    args = '{"q": "a long question", "filters": {"k": [1, 2]}}'
    text = '<tool_call>\n{"name": "lookup", "arguments": ' + args + "}\n</tool_call>"
    stream, pieces = ToolDeltas(HERMES), []
    for i in range(0, len(text), 3):
        for d in stream.deltas(text[i : i + 3], i + 3 >= len(text)):
            assert "content" not in d, d
            pieces += d["tool_calls"]
    assert len(pieces) > 10 and pieces[0]["function"] == {"name": "lookup", "arguments": ""}
    got = _joined(pieces)[0]["function"]["arguments"]
    assert got == args
    assert got == ToolParser(HERMES).parse(text)[1][0].arguments


def test_plain_text_and_a_broken_block_stay_text():
    assert ToolParser(HERMES).parse("Hello <tool_ there") == ("Hello <tool_ there", [])
    content, calls = ToolParser(HERMES).parse("<tool_call>\nnot json\n</tool_call>")
    assert calls == [] and "not json" in content


CUT_TEXT = 'Hi.<tool_call>\n{"name": "f", "arguments": {"a": [1, -2.5e3, true], "b": "x\\ny"}}\n</tool_call>'


def test_a_hermes_answer_cut_anywhere_streams_as_it_parses():
    """Every prefix of an answer (as max_tokens cuts it): streamed split anywhere, the joined deltas equal
    the unstreamed parse, and a call announced once its head is whole stays a call whose arguments are
    valid JSON beginning with what was streamed."""
    head_end = CUT_TEXT.index('"arguments": ') + len('"arguments": {')
    for cut in range(len(CUT_TEXT) + 1):
        parsed = check_streams(lambda: ChatOutput(None, JsonCallParser(HERMES)), CUT_TEXT[:cut])
        assert len(parsed.calls) == (cut >= head_end), cut
        if cut >= head_end:
            assert parsed.calls[0].name == "f" and parsed.content == "Hi.", cut
            assert CUT_TEXT[head_end - 1 : cut].startswith(parsed.calls[0].arguments.rstrip('"]}')), cut


@pytest.mark.parametrize(
    ("arguments", "kept"),
    [('{"city": "Par', {"city": "Par"}), ('{"city": "Paris", "da', {"city": "Paris"}),
     ('{"city": "Paris", "days": tr', {"city": "Paris"}), ('{"days": 3,, "x"}}', {"days": 3})],
)  # fmt: skip
def test_a_hermes_block_cut_or_broken_after_its_head_is_a_call(arguments, kept):
    text = 'Checking.<tool_call>\n{"name": "get_weather", "arguments": ' + arguments
    parsed = check_streams(lambda: ChatOutput(None, JsonCallParser(HERMES)), text)
    assert parsed.content == "Checking." and args(parsed) == [("get_weather", kept)]


def test_llama3_json():
    text = '<|python_tag|>{"name": "add", "parameters": {"a": 1, "b": 2}}; '
    text += '{"name": "get_weather", "parameters": {}}'
    content, calls = ToolParser(LLAMA3).parse(text)
    assert content is None and [c.name for c in calls] == ["add", "get_weather"]
    assert ToolParser(LLAMA3).parse("The answer is 3.") == ("The answer is 3.", [])
    assert parser_for("{{ '<|python_tag|>' }}") == LLAMA3 and parser_for("<|im_start|>") == HERMES


def test_tool_choice_and_the_forcing_grammar():
    assert chosen_tools(TOOLS, "none") == ([], "none")
    assert chosen_tools(TOOLS, None) == (TOOLS, "auto")
    assert chosen_tools(TOOLS, {"type": "function", "function": {"name": "add"}}) == ([TOOLS[1]], "named")
    with pytest.raises(APIError, match="'nope'"):
        chosen_tools(TOOLS, {"type": "function", "function": {"name": "nope"}})
    assert tool_grammar(TOOLS, "auto", True, HERMES) is None
    for fmt in (HERMES, LLAMA3):
        check_grammar(GrammarSpec("structural_tag", tool_grammar(TOOLS, "required", True, fmt)))
    bad = [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]
    with pytest.raises(APIError, match=r"tools\[0\].function.parameters"):
        tool_grammar(bad, "required", True, HERMES)


def test_response_formats_become_grammars():
    def req(**kw):
        return ChatCompletionRequest.model_validate(
            {"model": "m", "messages": [{"role": "user", "content": "x"}], **kw}
        )

    spec, where = requested_grammar(
        req(
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "n", "schema": {"type": "object"}},
            }
        )
    )
    assert (spec.kind, spec.strict, where) == ("json", True, "response_format.json_schema.schema")
    assert requested_grammar(req(response_format={"type": "json_object"}))[0].kind == "json_object"
    assert requested_grammar(req(guided_choice=["a", "b"]))[0] == GrammarSpec("choice", '["a", "b"]')
    assert requested_grammar(req(structured_outputs={"grammar": 'root ::= "x"'}))[0].kind == "ebnf"
    assert requested_grammar(req()) is None
    with pytest.raises(APIError, match="one structured output"):
        requested_grammar(req(guided_regex="a", guided_json={"type": "object"}))
    with pytest.raises(GrammarError, match="invalid regex"):
        check_grammar(GrammarSpec("regex", "(ab"))


def test_sampling_params_take_the_grammar_as_a_dict():
    p = SamplingParams(grammar={"kind": "regex", "spec": "a+"})
    assert p.grammar == GrammarSpec("regex", "a+")
    with pytest.raises(ValueError, match="grammar kind"):
        SamplingParams(grammar={"kind": "xml", "spec": "x"})
    with pytest.raises(ValueError, match="bad grammar"):
        SamplingParams(grammar={"kind": "regex", "spec": "a", "extra": 1})


def test_an_sdk_assistant_message_appended_back_as_is_is_taken():
    msg = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "audio": None,
        "function_call": None,
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
        ],
    }
    req = ChatCompletionRequest.model_validate(
        {
            "model": "m",
            "messages": [
                {"role": "user", "content": "x"},
                msg,
                {"role": "tool", "tool_call_id": "c1", "content": "2"},
            ],
        }
    )
    from splitserve.router.tools import render_messages

    hermes = render_messages(req.messages, TOOLS, native=False)
    assert hermes[0]["role"] == "system" and "<tools>" in hermes[0]["content"]
    assert '<tool_call>\n{"name": "add", "arguments": {"a": 1}}\n</tool_call>' in hermes[2]["content"]
    assert hermes[3]["content"] == "<tool_response>\n2\n</tool_response>"
    native = render_messages(req.messages, TOOLS, native=True)
    assert native[1]["tool_calls"] == [
        {"type": "function", "function": {"name": "add", "arguments": {"a": 1}}}
    ]
    assert native[2]["tool_call_id"] == "c1"
