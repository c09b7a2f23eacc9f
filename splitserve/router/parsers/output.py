"""One choice's text as a chat message: the reasoning parser first, then the tool-call parser on the
content after the thinking (either may be off).

Unstreamed, `parse(text)` gives the message's parts: `reasoning`, `content`, `calls`. Streamed,
`deltas(text, finished)` gives the chat deltas for one piece of text: `{"reasoning_content": ..,
"reasoning": ..}` (vLLM's older and newer names for the same text), `{"content": ..}`, and tool calls as
OpenAI streams them (`base.CallDeltas`). Joined, the deltas of a stream equal the unstreamed parts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from splitserve.router.parsers.base import CallDeltas, ToolCall, ToolCallParser
from splitserve.router.parsers.reasoning import REASONING, ReasoningParser


@dataclass
class Parsed:
    content: str | None
    reasoning: str | None = None
    calls: list[ToolCall] = field(default_factory=list)

    def message_fields(self) -> dict[str, Any]:
        """The assistant message's fields: `content`, and `reasoning_content` / `reasoning` and
        `tool_calls` when there are any."""
        out: dict[str, Any] = {"content": self.content}
        if self.reasoning is not None:
            out["reasoning_content"] = out["reasoning"] = self.reasoning
        if self.calls:
            out["tool_calls"] = [call.to_openai() for call in self.calls]
        return out


class ChatOutput:
    """One choice's parsers: `reasoning` (None: no thinking to take apart) and `tools` (None: no tool
    calls looked for). A fresh one per choice, used whole (`parse`) or streamed (`deltas`)."""

    def __init__(self, reasoning: ReasoningParser | None, tools: ToolCallParser | None) -> None:
        self.reasoning = reasoning
        self.tools = tools
        self._calls = CallDeltas(tools) if tools is not None else None

    @property
    def calls(self) -> int:
        """Calls announced so far in the stream."""
        return self._calls.calls if self._calls is not None else 0

    def parse(self, text: str) -> Parsed:
        reasoning, content = self.reasoning.parse(text) if self.reasoning is not None else (None, text)
        if self.tools is None:
            return Parsed(content or None, reasoning)
        content_or_none, calls = self.tools.parse(content)
        return Parsed(content_or_none, reasoning, calls)

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        pieces = self.reasoning.feed(text) if self.reasoning is not None and text else []
        if self.reasoning is not None and finished:
            pieces += self.reasoning.finish()
        if self.reasoning is None:
            pieces = [("content", text)] if text else []
        out: list[dict[str, Any]] = []
        for kind, piece in pieces:
            if kind == REASONING:
                out.append({"reasoning_content": piece, "reasoning": piece})
            elif self._calls is None:
                out.append({"content": piece})
            else:
                out += self._calls.events_to_deltas(self._calls.parser.feed(piece))
        if finished and self._calls is not None:
            out += self._calls.events_to_deltas(self._calls.parser.finish())
        return _merged(out)


def _merged(deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neighbouring deltas of the same text field as one (fewer, larger chunks; the same joined text)."""
    out: list[dict[str, Any]] = []
    for d in deltas:
        if out and "tool_calls" not in d and set(d) == set(out[-1]):
            out[-1] = {k: out[-1][k] + d[k] for k in d}
        else:
            out.append(dict(d))
    return out


__all__ = ["ChatOutput", "Parsed"]
