"""Hermes and Llama 3 JSON tool calls (`hermes`, `llama3_json`).

`hermes` (Qwen2.5/Qwen3, SmolLM2-style chatml): `<tool_call>{"name", "arguments"}</tool_call>` blocks;
`llama3_json`: `{"name", "parameters"}` objects, `;`-separated, after an optional `<|python_tag|>`.
`ToolParser.feed` reads a stream, holding back text that may be the start of a call, and hands out each
call once it is whole; `open_call` tells the Hermes call being written once its name is whole.
`JsonCallParser` turns that into the events every family's parser gives (`base.py`): a Hermes call is
announced as soon as its name is whole and its arguments follow in fragments as the model writes them;
Llama 3 JSON calls (whose end is known only at the end of the answer) come whole at the end.

A Hermes block whose head is whole is a call, streamed or not, even when it never closes (cut by
`max_tokens`) or its JSON breaks off: a stream announced it when the head was whole, and the unstreamed
answer keeps what the stream said. Its arguments are what came of the object, closed (`json_prefix.py`),
and a stream sends only the part that closing will keep, so the joined fragments equal them; the
request's `finish_reason` (`length`) says it was cut. vLLM's Hermes stream announces such a call the
same way; its unstreamed parse turns the whole answer back into content, which this parser does not.
"""

from __future__ import annotations

import json
import re
from typing import Any

from splitserve.router.parsers.base import (
    CallArgs,
    CallStart,
    ContentTrim,
    Event,
    Text,
    ToolCall,
    new_call_id,
    partial_suffix,
)
from splitserve.router.parsers.json_prefix import JsonPrefix, closed

HERMES, LLAMA3 = "hermes", "llama3_json"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# a Hermes block's head once its name is whole and an object of arguments has begun
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


class ToolParser:
    """Calls out of the model's text. `parse(text)` for a whole answer; `feed(delta)` for a stream:
    -> (content to send now, calls completed now); `finish()` at the end -> (the rest, its calls)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._buf = ""  # text not yet handed out
        self._in_calls = False  # llama3_json: the answer is calls from its start
        self._after_call = False  # hermes: a block just closed (a newline after it is dropped)
        self._block_id: str | None = None  # hermes: the id of the call whose block is open
        self._block_head: tuple[str, int] | None = None  # its name, where its arguments begin in the block
        self._block_args = JsonPrefix()  # its arguments as streamed so far

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.feed(text)
        rest, more = self.finish()
        content = (content + rest).strip()
        return (content or None), calls + more

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        if self.fmt == LLAMA3:
            return self._feed_llama()
        return self._feed_hermes()

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self.fmt == LLAMA3 and self._in_calls:
            calls = _llama_calls(rest)
            return ("", calls) if calls is not None else (rest, [])
        if _HERMES_OPEN in rest:  # an unclosed block (cut by max_tokens): try it whole
            head, _, body = rest.partition(_HERMES_OPEN)
            call = _hermes_call(body, self._take_block_id())
            return (head, [call]) if call is not None else (rest, [])
        return rest, []

    def open_call(self) -> tuple[str, str, str] | None:
        """The Hermes call being written, once its name is whole: -> (its id, its name, the text of its
        arguments so far that JSON can close by appending alone (`json_prefix.py`), less a tail that may
        yet turn out to close the block); None otherwise."""
        if self.fmt != HERMES or not self._buf.startswith(_HERMES_OPEN):
            return None
        body = self._buf[len(_HERMES_OPEN) :]
        if self._block_head is None:  # matched once a block: its text before the arguments is fixed
            head = _HERMES_HEAD.match(body)
            if head is None:
                return None
            self._block_head = (_json_string(head.group(1)), head.end())
            self._block_id = self._block_id or new_call_id()
        name, start = self._block_head
        assert self._block_id is not None  # set with the head, cleared with it (_take_block_id)
        rest = body[start:]
        ready, scan = rest[: len(rest) - partial_suffix(rest, _HERMES_CLOSE)], self._block_args
        scan.feed(ready[scan.read :])  # NOTE: `ready` only grows: a held tail begins at its only '<'
        return self._block_id, name, ready[: scan.safe]

    def _take_block_id(self) -> str:
        block_id, self._block_id, self._block_head = self._block_id or new_call_id(), None, None
        self._block_args = JsonPrefix()
        return block_id

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        out, calls = "", []
        while True:
            if self._after_call and self._buf:  # the newline between two blocks is no content
                self._buf = self._buf.lstrip("\n")
                self._after_call = not self._buf
            start = self._buf.find(_HERMES_OPEN)
            if start == -1:
                keep = partial_suffix(self._buf, _HERMES_OPEN)
                out += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return out, calls
            out += self._buf[:start]
            end = self._buf.find(_HERMES_CLOSE, start)
            if end == -1:
                self._buf = self._buf[start:]
                return out, calls
            call = _hermes_call(self._buf[start + len(_HERMES_OPEN) : end], self._take_block_id())
            if call is not None:
                calls.append(call)
            else:  # not a call after all: it is text
                out += self._buf[start : end + len(_HERMES_CLOSE)]
            self._buf = self._buf[end + len(_HERMES_CLOSE) :]
            self._after_call = call is not None

    def _feed_llama(self) -> tuple[str, list[ToolCall]]:
        if not self._in_calls:
            head = self._buf.lstrip()
            if not head or _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]) and len(head) < len(_PYTHON_TAG):
                return "", []  # undecided yet
            if head.startswith(("{", _PYTHON_TAG)):
                self._in_calls = True
                return "", []
            out, self._buf = self._buf, ""
            return out, []
        return "", []  # calls are handed out whole at the end


def _json_string(escaped: str) -> str:
    try:
        return json.loads(f'"{escaped}"')
    except ValueError:
        return escaped


def _hermes_call(body: str, call_id: str) -> ToolCall | None:
    """A block's call. One whose head (name, then an object of arguments) is whole is a call whatever
    follows, as a stream announced it once the head was whole: its arguments are the object the model
    wrote, up to where it closes, or (cut by max_tokens, or broken off) the longest part of it that JSON
    can close, closed. Any other block is a call only if it is whole JSON of a call; else it is text."""
    head = _HERMES_HEAD.match(body)
    if head is not None:
        return ToolCall(_json_string(head.group(1)), closed(body[head.end() :]), call_id)
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    return _call_of(obj, "arguments", call_id)


def _call_of(obj: Any, key: str, call_id: str | None = None) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}))
    if isinstance(args, str):
        args = _obj(args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), call_id or new_call_id())


def _llama_calls(text: str) -> list[ToolCall] | None:
    text = text.strip().removeprefix(_PYTHON_TAG).strip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call_of(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        while i < len(text) and text[i] in " ;\n":
            i += 1
    return calls or None


def _obj(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


class JsonCallParser:
    """`ToolParser` as the events every family's parser gives: content, a Hermes call announced once its
    name is whole (then its arguments in fragments), a Llama 3 JSON call whole at the end."""

    def __init__(self, fmt: str) -> None:
        self.tools = ToolParser(fmt)
        self._open: str | None = None  # the announced call's id
        self._sent = ""  # its arguments sent so far
        self._trim = ContentTrim()

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return self.tools.parse(text)

    def feed(self, delta: str) -> list[Event]:
        content, calls = self.tools.feed(delta)
        return self._events(content, calls, finished=False)

    def finish(self) -> list[Event]:
        rest, calls = self.tools.finish()
        return self._events(rest, calls, finished=True)

    def _events(self, content: str, calls: list[ToolCall], finished: bool) -> list[Event]:
        content = self._trim(content)
        out: list[Event] = [Text(content)] if content else []
        if calls or finished or self.tools.open_call() is not None:
            self._trim.drop()  # white space before a call, or at the end, is no content
        for call in calls:
            if call.id == self._open:  # the announced call, now whole: the rest of its arguments
                if call.arguments.startswith(self._sent) and len(call.arguments) > len(self._sent):
                    out.append(CallArgs(call.id, call.arguments[len(self._sent) :]))
                self._open = None
                continue
            out += [CallStart(call.id, call.name), CallArgs(call.id, call.arguments)]
        writing = None if finished else self.tools.open_call()
        if writing is not None:
            call_id, name, arguments = writing
            if self._open != call_id:
                self._open, self._sent = call_id, ""
                out.append(CallStart(call_id, name))
            if len(arguments) > len(self._sent) and arguments.startswith(self._sent):
                out.append(CallArgs(call_id, arguments[len(self._sent) :]))
                self._sent = arguments
        return out


__all__ = ["HERMES", "LLAMA3", "JsonCallParser", "ToolParser"]
