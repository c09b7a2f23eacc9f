"""What every tool-call parser shares: the call as OpenAI sends it, the interface a model family's parser
implements, and the streamed deltas a parser's events become.

A parser reads the text of the answer (after any thinking, see `reasoning.py`) and finds the calls in it.
Unstreamed, `parse(text)` gives (content, calls). Streamed, `feed(delta)` gives a list of events as the
text goes by, and `finish()` the last of them when the answer ends:
  - `Text(s)`: content to send now (text that cannot be part of a call);
  - `CallStart(id, name)`: a call whose name is whole; OpenAI sends it once, with `arguments` "";
  - `CallArgs(id, fragment)`: the next piece of that call's `arguments` JSON text.
The fragments of a call join to the `arguments` the unstreamed parse gives it, and the `Text` events join
to its content (`parse` trims only the white space at the two ends). `CallDeltas` turns events into chat
deltas numbered by `index` as OpenAI does.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field
from typing import Any, Protocol


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=new_call_id)

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        if index is not None:
            out["index"] = index
        return out


@dataclass(frozen=True)
class Text:
    text: str


@dataclass(frozen=True)
class CallStart:
    id: str
    name: str


@dataclass(frozen=True)
class CallArgs:
    id: str
    fragment: str


Event = Text | CallStart | CallArgs


class ToolCallParser(Protocol):
    """One answer's parser (a fresh one per choice): whole with `parse`, or streamed with `feed` and
    `finish`, never both."""

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]: ...

    def feed(self, delta: str) -> list[Event]: ...

    def finish(self) -> list[Event]: ...


def collect(events: list[Event]) -> tuple[str | None, list[ToolCall]]:
    """Events as the unstreamed answer: (content trimmed, or None when empty; the calls)."""
    content, names, args = "", {}, {}
    for ev in events:
        if isinstance(ev, Text):
            content += ev.text
        elif isinstance(ev, CallStart):
            names[ev.id], args[ev.id] = ev.name, ""
        else:
            args[ev.id] += ev.fragment
    content = content.strip()
    return (content or None), [ToolCall(names[i], args[i], i) for i in names]


def partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


class ContentTrim:
    """Content as a stream sends it, trimmed as the unstreamed parse trims it: white space is held back
    until more text follows it, so the white space that leads the answer, comes before a call or ends
    the answer is never sent (`drop` forgets what is held)."""

    def __init__(self) -> None:
        self._held = ""
        self._sent = False

    def __call__(self, text: str) -> str:
        body = text.rstrip()
        if not body:
            self._held += text
            return ""
        out = (self._held + body) if self._sent else body.lstrip()
        self._sent, self._held = True, text[len(body) :]
        return out

    def drop(self) -> None:
        self._held = ""


class CallDeltas:
    """One streamed choice's chat deltas from a parser: content runs, each call announced once (id, type,
    name, arguments "") with the next `index`, then its argument fragments under that index."""

    def __init__(self, parser: ToolCallParser) -> None:
        self.parser = parser
        self.calls = 0  # calls announced so far
        self._index: dict[str, int] = {}

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        events = self.parser.feed(text) if text else []
        if finished:
            events += self.parser.finish()
        return self.events_to_deltas(events)

    def events_to_deltas(self, events: list[Event]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for ev in events:
            if isinstance(ev, Text):
                if not ev.text:
                    continue
                if out and set(out[-1]) == {"content"}:  # one delta per run of text
                    out[-1]["content"] += ev.text
                else:
                    out.append({"content": ev.text})
            elif isinstance(ev, CallStart):
                self._index[ev.id] = self.calls
                out.append({"tool_calls": [ToolCall(ev.name, "", ev.id).to_openai(self.calls)]})
                self.calls += 1
            elif ev.fragment:
                fragment = {"index": self._index[ev.id], "function": {"arguments": ev.fragment}}
                out.append({"tool_calls": [fragment]})
        return out


__all__ = ["CallArgs", "CallDeltas", "CallStart", "ContentTrim", "Event", "Text", "ToolCall",
           "ToolCallParser", "collect", "new_call_id", "partial_suffix"]  # fmt: skip
