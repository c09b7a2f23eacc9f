"""Qwen3-Coder / Qwen3.5 tool calls (`qwen3_coder`, alias `qwen3_xml`): XML blocks, one call each,

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

What the parser decides, streamed and unstreamed alike:
  - A block is a call once `<tool_call>`, white space and `<function=NAME>` are whole; the call is then
    announced (id, name) and its parameters follow as fragments of its `arguments` JSON: `{"city": `,
    `"Par`, `is"`, then `, "days": 3` ... and `}` when `</function>` closes it. A value that stays text
    (declared a string, or not typed) is sent as the model writes it; a typed one when its
    `</parameter>` arrives, as the type the tool's schema declares (`xml_values.py`). A value loses
    exactly one leading and one trailing blank (the newlines the format puts around it), no more:
    code's indentation and a string's own blank lines stay.
  - `<tool_call>` that is not followed by that head (prose that names the tag) is text: it is sent as
    content as soon as a character rules the head out, so a stream never waits on it.
  - A block cut before `</tool_call>` (max_tokens): a block whose head was whole is still a call,
    since a stream has already announced it; its `arguments` hold the parameters that came (a text
    value cut short keeps what came of it, a typed one is dropped) and are closed with `}`, so they
    stay valid JSON; the request's `finish_reason` (`length`) says it was cut. A block cut inside its
    head is content.
  - White space before the first content, between calls and after the last one is not content.
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.router.parsers.base import (
    CallArgs,
    CallStart,
    ContentTrim,
    Event,
    Text,
    ToolCall,
    collect,
    new_call_id,
    partial_suffix,
)
from splitserve.router.parsers.xml_values import convert, declared_types

OPEN, CLOSE = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"
MAX_NAME = 256  # a name longer than this (or with a newline or '<' in it) means the text is no call
MAX_GAP = 64  # white space allowed between `<tool_call>` and `<function=`
# one of these at each end of a value is the format's (a newline, as Qwen's template writes it), not
# the value's; xgrammar's `qwen_xml` style, which forces calls (tools.py), reads values the same way
BLANK = (" ", "\t", "\r", "\n")


class Qwen3XmlParser:
    """One answer's calls (see the module docstring); `tools`: the request's OpenAI tools, whose
    parameter schemas give each value its type."""

    def __init__(self, tools: list[dict[str, Any]] | None = None) -> None:
        self._schemas = {
            (t.get("function") or {}).get("name"): ((t.get("function") or {}).get("parameters") or {})
            for t in tools or []
            if isinstance(t, dict)
        }
        self._buf = ""  # text not yet consumed
        self._state = "text"  # text | params | pname | value | tail
        self._trim = ContentTrim()
        self._call: str | None = None  # the open call's id
        self._name = ""
        self._params = 0  # parameters sent for the open call
        self._param = ""  # the parameter whose value is being read
        self._schema: Any = None  # its schema (None: not declared)
        self._text_value = True  # its value stays text: sent as it comes
        self._value_open = False  # its `"name": ` has been sent

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        return collect(self.feed(text) + self.finish())

    def feed(self, delta: str) -> list[Event]:
        self._buf += delta
        out: list[Event] = []
        step = {"text": self._in_text, "params": self._in_params, "pname": self._in_pname,
                "value": self._in_value, "tail": self._in_tail}  # fmt: skip
        while step[self._state](out):
            pass
        return out

    def finish(self) -> list[Event]:
        out: list[Event] = []
        if self._state == "text":
            self._text(self._buf, out)
        elif self._call is not None:  # cut inside a block whose head was whole: close the call
            if self._value_open:  # a text value cut short keeps what came of it
                out.append(CallArgs(self._call, '"'))
                self._params += 1
            self._close_call(out)
        self._buf = ""
        self._trim.drop()
        return out

    # ---- one step per state: consume what can be decided, say whether to go on ------------------------

    def _in_text(self, out: list[Event]) -> bool:
        start = self._buf.find(OPEN)
        if start == -1:
            keep = partial_suffix(self._buf, OPEN)
            self._text(self._buf[: len(self._buf) - keep], out)
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        head = _head(self._buf[start + len(OPEN) :])
        if head is None:  # not decided yet: wait for more text
            self._text(self._buf[:start], out)
            self._buf = self._buf[start:]
            return False
        if head is False:  # not a call: the tag is text
            self._text(self._buf[: start + len(OPEN)], out)
            self._buf = self._buf[start + len(OPEN) :]
            return True
        name, end = head
        self._text(self._buf[:start], out)
        self._trim.drop()  # white space before a call is no content
        self._buf = self._buf[start + len(OPEN) + end :]
        self._call, self._name, self._params = new_call_id(), name, 0
        out.append(CallStart(self._call, name))
        self._state = "params"
        return True

    def _in_params(self, out: list[Event]) -> bool:
        """Between parameters: the next `<parameter=` or the `</function>` that ends the call (anything
        else between them is skipped)."""
        nxt = [(i, tag) for tag in (PARAM, FUNCTION_END) if (i := self._buf.find(tag)) != -1]
        if not nxt:
            keep = max(partial_suffix(self._buf, PARAM), partial_suffix(self._buf, FUNCTION_END))
            self._buf = self._buf[len(self._buf) - keep :]
            return False
        i, tag = min(nxt)
        self._buf = self._buf[i + len(tag) :]
        if tag == FUNCTION_END:
            self._close_call(out)
            self._state = "tail"
        else:
            self._state = "pname"
        return True

    def _in_pname(self, out: list[Event]) -> bool:
        end = self._buf.find(">")
        if end == -1 or end > MAX_NAME:
            if len(self._buf) > MAX_NAME:  # no name: skip the stray tag
                self._state = "params"
                return True
            return False
        self._param, self._buf = self._buf[:end].strip(), self._buf[end + 1 :]
        schema = (self._schemas.get(self._name) or {}).get("properties") or {}
        self._schema = schema.get(self._param) if self._param in schema else None
        self._text_value = all(kind == "string" for kind in declared_types(self._schema))
        self._value_open = False
        self._state = "value"
        return True

    def _in_value(self, out: list[Event]) -> bool:
        """A parameter's value up to `</parameter>`. A value that stays text (declared a string, or with
        no type) is sent as it comes, less a tail that may be the closing newline or tag."""
        end = self._buf.find(PARAM_END)
        if end == -1:
            if self._text_value:
                ready = len(self._buf) - partial_suffix(self._buf, PARAM_END)
                ready -= self._buf[:ready][-1:] in BLANK  # may be the blank the format puts before the tag
                self._send_text_value(self._buf[:ready], out)
                self._buf = self._buf[ready:]
            return False
        raw, self._buf = self._buf[:end], self._buf[end + len(PARAM_END) :]
        if self._text_value:
            self._send_text_value(raw[:-1] if raw[-1:] in BLANK else raw, out)
            self._send_value_part('"' if self._value_open else '""', out)
        else:
            raw = raw[raw[:1] in BLANK :]
            raw = raw[:-1] if raw[-1:] in BLANK else raw
            self._send_value_part(json.dumps(convert(raw, self._schema), ensure_ascii=False), out)
        self._value_open = False
        self._params += 1
        self._state = "params"
        return True

    def _send_text_value(self, text: str, out: list[Event]) -> None:
        if not self._value_open:  # the value's first characters: less the newline opening it
            if not text:
                return
            text = text[text[:1] in BLANK :]
            self._send_value_part('"', out)
        if text:
            self._send_value_part(json.dumps(text, ensure_ascii=False)[1:-1], out)

    def _send_value_part(self, part: str, out: list[Event]) -> None:
        """The next piece of the open parameter's `"name": value` in the arguments."""
        assert self._call is not None  # set with the head, the only way into a value
        if not self._value_open:
            sep = "{" if self._params == 0 else ", "
            part = f"{sep}{json.dumps(self._param, ensure_ascii=False)}: {part}"
            self._value_open = True
        out.append(CallArgs(self._call, part))

    def _in_tail(self, out: list[Event]) -> bool:
        """After `</function>`: white space and `</tool_call>`; anything else is content again."""
        rest = self._buf.lstrip()
        if not rest or (CLOSE.startswith(rest) and len(rest) < len(CLOSE)):
            return False
        self._buf = rest[len(CLOSE) :] if rest.startswith(CLOSE) else rest
        self._state = "text"
        return True

    # ---- helpers ------------------------------------------------------------------------------------

    def _close_call(self, out: list[Event]) -> None:
        assert self._call is not None
        out.append(CallArgs(self._call, "}" if self._params else "{}"))
        self._call = None

    def _text(self, text: str, out: list[Event]) -> None:
        if sent := self._trim(text):
            out.append(Text(sent))


def _head(rest: str) -> tuple[str, int] | bool | None:
    """What follows `<tool_call>`: (the function's name, where its head ends) when `<function=NAME>` is
    whole; None while it may still become one; False when it cannot."""
    body = rest.lstrip()
    gap = len(rest) - len(body)
    if gap > MAX_GAP:
        return False
    if len(body) < len(FUNCTION):
        return None if FUNCTION.startswith(body) else False
    if not body.startswith(FUNCTION):
        return False
    name_end = body.find(">", len(FUNCTION))
    name = body[len(FUNCTION) : name_end if name_end != -1 else None]
    if "\n" in name or "<" in name or len(name) > MAX_NAME:
        return False
    if name_end == -1:
        return None
    return (name.strip(), gap + name_end + 1) if name.strip() else False


__all__ = ["Qwen3XmlParser"]
