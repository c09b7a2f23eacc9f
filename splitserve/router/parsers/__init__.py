"""Parsers of a model's output, per model family, by vLLM's names: tool calls (`--tool-call-parser`) and
reasoning (`--reasoning-parser`).

Reading order: `base` (the call, the events a tool-call parser gives, how they become OpenAI deltas),
`json_calls` (`hermes`, `llama3_json`), `qwen3_xml` (`qwen3_coder` alias `qwen3_xml`, with
`xml_values` for the parameters' types), `reasoning` (`qwen3`, `deepseek_r1`), `output` (both in turn
over one choice's text, whole or streamed).

Which parser a model needs is read off its chat template (`tool_parser_for_template`,
`reasoning_parser_for_template`); a parser named at start that does not fit the template is refused
(`check_tool_parser`, `check_reasoning_parser`) with the name of the one that does.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splitserve.router.parsers.base import ToolCall, ToolCallParser
from splitserve.router.parsers.json_calls import HERMES, LLAMA3, JsonCallParser
from splitserve.router.parsers.output import ChatOutput, Parsed
from splitserve.router.parsers.qwen3_xml import Qwen3XmlParser
from splitserve.router.parsers.reasoning import DEEPSEEK_R1, QWEN3, ReasoningParser, starts_in_reasoning

QWEN3_CODER = "qwen3_coder"
TOOL_PARSERS = (HERMES, LLAMA3, QWEN3_CODER, "qwen3_xml")
REASONING_PARSERS = (QWEN3, DEEPSEEK_R1)
_ALIASES = {"qwen3_xml": QWEN3_CODER}
_FORMATS = {
    HERMES: '<tool_call>{"name": .., "arguments": ..}</tool_call>',
    LLAMA3: '{"name": .., "parameters": ..}',
    QWEN3_CODER: "<tool_call><function=..><parameter=..>",
}


def canonical_tool_parser(name: str) -> str:
    """A tool-call parser's name with aliases resolved; ValueError for a name not known."""
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}: choose one of {', '.join(TOOL_PARSERS)}")
    return _ALIASES.get(name, name)


def tool_parser_for_template(template: str | None) -> str:
    """The tool-call format a chat template asks for (a template that renders no tools gets Hermes text
    written by the server, so `hermes`)."""
    text = template or ""
    if "<function=" in text and "<parameter=" in text:
        return QWEN3_CODER
    if "<|python_tag|>" in text or "ipython" in text:
        return LLAMA3
    return HERMES


def reasoning_parser_for_template(template: str | None) -> str | None:
    """The reasoning shape of a chat template: `deepseek_r1` (DeepSeek's, the prompt opens the block),
    `qwen3` (a `<think>` block), or None (the model does not think in a block)."""
    text = template or ""
    if "</think>" not in text and "<think>" not in text:
        return None
    return DEEPSEEK_R1 if "<｜Assistant｜>" in text else QWEN3


def check_tool_parser(name: str, template: str | None) -> str:
    """`name` resolved, or ValueError naming the parser the template asks for."""
    chosen, fits = canonical_tool_parser(name), tool_parser_for_template(template)
    if chosen != fits:
        raise ValueError(
            f"--tool-call-parser {name} does not fit this model: its chat template asks for {fits} calls "
            f"({_FORMATS[fits]}), so use --tool-call-parser {fits} (or leave it out: the template picks it)"
        )
    return chosen


def check_reasoning_parser(name: str, template: str | None) -> str:
    """`name` if the template thinks in that shape, else ValueError naming the one that fits (or none)."""
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}: choose one of {', '.join(REASONING_PARSERS)}")
    fits = reasoning_parser_for_template(template)
    if fits is None:
        raise ValueError(
            f"--reasoning-parser {name} does not fit this model: its chat template has no <think> block; "
            "leave --reasoning-parser out"
        )
    if fits != name:
        raise ValueError(f"--reasoning-parser {name} does not fit this model: its chat template is of the "
                         f"{fits} shape, so use --reasoning-parser {fits}")  # fmt: skip
    return name


def chosen_parsers(tool: str | None, reasoning: str | None, template: str | None) -> tuple[str, str | None]:
    """The server's parsers: (tool-call parser, reasoning parser or None) as configured (`reasoning`
    "none": off), each read off the template when not given; ValueError when a given one does not fit."""
    tool_name = check_tool_parser(tool, template) if tool else tool_parser_for_template(template)
    if reasoning == "none":
        return tool_name, None
    return tool_name, (check_reasoning_parser(reasoning, template) if reasoning
                       else reasoning_parser_for_template(template))  # fmt: skip


def chat_outputs(
    tool_format: str | None, tools: list[dict[str, Any]] | None, reasoning: str | None, prompt_tail: str
) -> Callable[[], ChatOutput] | None:
    """A request's maker of per-choice output parsers (None when there is nothing to parse): calls in
    `tool_format` when tools are on, thinking of the `reasoning` shape after a prompt ending in
    `prompt_tail`."""
    if tool_format is None and reasoning is None:
        return None

    def make() -> ChatOutput:
        return ChatOutput(
            reasoning_parser(reasoning, prompt_tail) if reasoning is not None else None,
            tool_parser(tool_format, tools) if tool_format is not None else None,
        )

    return make


def tool_parser(name: str, tools: list[dict[str, Any]] | None = None) -> ToolCallParser:
    """A fresh parser of one answer's calls; `tools` (the request's) type the XML parser's values."""
    name = canonical_tool_parser(name)
    return Qwen3XmlParser(tools) if name == QWEN3_CODER else JsonCallParser(name)


def reasoning_parser(name: str, prompt_tail: str) -> ReasoningParser:
    """A fresh parser of one answer's thinking; `prompt_tail`: the end of the rendered prompt's text
    (whether it opened the thinking block)."""
    return ReasoningParser(starts_in_reasoning(name, prompt_tail))


__all__ = ["DEEPSEEK_R1", "HERMES", "LLAMA3", "QWEN3", "QWEN3_CODER", "REASONING_PARSERS", "TOOL_PARSERS",
           "ChatOutput", "Parsed", "ToolCall", "ToolCallParser", "canonical_tool_parser", "chat_outputs",
           "check_reasoning_parser", "check_tool_parser", "chosen_parsers", "reasoning_parser",
           "reasoning_parser_for_template", "tool_parser", "tool_parser_for_template"]  # fmt: skip
