"""The longest prefix of a JSON value being written that JSON can close by appending text alone.

A Hermes call's `arguments` stream as the model writes them, and a block cut by `max_tokens` (or broken
off) must still end as valid JSON whose text begins with everything already streamed. `JsonPrefix` reads
the text a piece at a time and keeps `(safe, closer)`: `text[:safe] + closer` is valid JSON, `safe` is as
large as it can be, and it only grows as text comes. Points where an appended closer cannot make the text
valid are never `safe`: inside a key, after a `,` or `:`, inside `tru` or `1.`, inside an escape. Inside a
string value every character is (the closer closes the string).

    {"city": "Par      ->  safe after "Par, closer '"}'
    {"city": "Paris",  ->  safe after "Paris", closer '}'   (the comma waits for what follows it)

Reading stops where the outermost value closes (`whole`) or at text that is not JSON.
"""

from __future__ import annotations

import re

_NUMBER = re.compile(r"-?(?:0|[1-9]\d*)(?:\.\d+)?(?:[eE][+-]?\d+)?")
_LITERALS = ("true", "false", "null")
_BLANK = " \t\r\n"
_HEX = "0123456789abcdefABCDEF"


class JsonPrefix:
    """One JSON value read as it is written (see the module docstring)."""

    def __init__(self) -> None:
        self.read = 0  # characters read so far
        self.safe = 0  # text[:safe] + closer is valid JSON
        self.closer = ""
        self.whole = False  # the outermost value has closed
        self.stopped = False  # whole, or text that is not JSON: nothing more is read
        self._stack: list[str] = []  # open containers, "{" or "["
        self._state = "value"  # value | key | colon | after | string | key_string | escape | number | literal
        self._fresh = False  # right after an opening bracket: its end may come next
        self._token = ""  # the number, literal or \u escape being read

    def feed(self, text: str) -> None:
        for c in text:
            if self.stopped:
                return
            self.read += 1
            self._char(c)

    def _ends(self) -> str:
        return "".join("}" if b == "{" else "]" for b in reversed(self._stack))

    def _mark(self, extra: str = "") -> None:
        self.safe, self.closer = self.read, extra + self._ends()

    def _stop(self) -> None:
        self.stopped = True

    def _char(self, c: str) -> None:
        state = self._state
        if state in ("string", "key_string", "escape"):
            self._in_string(c)
        elif state == "number":
            self._in_number(c)
        elif state == "literal":
            self._in_literal(c)
        elif c in _BLANK:
            if state == "after" or self._fresh:
                self._mark()
        elif c in "}]" and (state == "after" or self._fresh):
            self._close(c)
        elif state == "after":
            if c == "," and self._stack:
                self._state = "key" if self._stack[-1] == "{" else "value"
            else:
                self._stop()
        elif state == "colon":
            self._state = "value" if c == ":" else self._state
            if c != ":":
                self._stop()
        elif state == "key":
            self._fresh = False
            if c == '"':
                self._state = "key_string"
            else:
                self._stop()
        else:
            self._value(c)

    def _value(self, c: str) -> None:
        self._fresh = False
        if c in "{[":
            self._stack.append(c)
            self._state, self._fresh = ("key" if c == "{" else "value"), True
            self._mark()
        elif c == '"':
            self._state = "string"
            self._mark('"')
        elif c == "-" or c.isdigit():
            self._state, self._token = "number", c
            self._number_mark()
        elif c in "tfn":
            self._state, self._token = "literal", c
        else:
            self._stop()

    def _close(self, c: str) -> None:
        if c != ("}" if self._stack[-1] == "{" else "]"):
            self._stop()
            return
        self._stack.pop()
        self._state, self._fresh = "after", False
        self._mark()
        if not self._stack:
            self.whole = True
            self._stop()

    def _in_string(self, c: str) -> None:
        key = self._state == "key_string" or (self._state == "escape" and self._token.startswith("k"))
        if self._state == "escape":
            self._escape(c, key)
            return
        if c == '"':
            self._state = "colon" if key else "after"
            if not key:
                self._mark()
        elif c == "\\":
            self._state, self._token = "escape", "k" if key else "v"
        elif ord(c) < 0x20:  # raw control characters are not JSON
            self._stop()
        elif not key:
            self._mark('"')

    def _escape(self, c: str, key: bool) -> None:
        """After a backslash: `self._token` is "k" or "v" (key or value), then the \\u digits so far."""
        digits = self._token[1:]
        if not digits and c in '"\\/bfnrt':
            done = True
        elif (digits or c == "u") and (c in _HEX or (c == "u" and not digits)):
            self._token += "u" if c == "u" else c
            done = len(self._token) == 6  # "k" or "v", "u", four hex digits
        else:
            self._stop()
            return
        if done:
            self._state = "key_string" if key else "string"
            if not key:
                self._mark('"')

    def _in_number(self, c: str) -> None:
        if c in "0123456789+-.eE":
            self._token += c
            self._number_mark()
            return
        if _NUMBER.fullmatch(self._token) is None:
            self._stop()
            return
        self._state = "after"
        self._char(c)  # the character after the number, read as what it is

    def _number_mark(self) -> None:
        if _NUMBER.fullmatch(self._token) is not None:
            self._mark()

    def _in_literal(self, c: str) -> None:
        self._token += c
        if self._token in _LITERALS:
            self._state = "after"
            self._mark()
        elif not any(lit.startswith(self._token) for lit in _LITERALS):
            self._stop()


def closed(text: str) -> str:
    """`text` (a JSON value being written) as valid JSON: its longest closable prefix, closed."""
    prefix = JsonPrefix()
    prefix.feed(text)
    return text[: prefix.safe] + prefix.closer


__all__ = ["JsonPrefix", "closed"]
