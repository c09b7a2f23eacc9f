"""The HTTP edge's JSON: parsed strictly, so that a request's shape cannot reach the code behind it
as a 500.

Refused (each a ValueError with the reason, answered 400 by the caller):
  NaN / Infinity      not JSON (Python's json accepts them; OpenAI's API does not)
  huge numbers        integers of more than MAX_INT_DIGITS digits (Python would refuse them later, as
                      a 500), floats beyond a double's range (1e400 would read as Infinity)
  deep nesting        more than MAX_DEPTH levels of arrays and objects
  lone surrogates     "\\ud800" escapes without their pair: not text, and not encodable as UTF-8

The checks that look at every value (an integer's digits, a string's surrogates, a container's depth)
run only where the text could hold what they refuse: a token-id prompt of 1,088 ids is 1,088 integers,
and a Python call per integer plus a walk over them cost ~0.3 ms of the request's way to its first
token. No run of more than MAX_INT_DIGITS digits: no integer can be too long; no \\u escape, and no
surrogate in the text: no string can hold a lone one; at most MAX_DEPTH brackets and braces: nothing
can nest deeper. Otherwise the whole check runs, and refuses as it always does.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64
MAX_INT_DIGITS = 32
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")
# a byte string's digits as b"0", every other byte as b" ": a run of digits is then a run of b"0"s
_DIGITS = bytes(48 if 48 <= b <= 57 else 32 for b in range(256))
_LONG_RUN = b"0" * (MAX_INT_DIGITS + 1)


def _constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


def _integer(text: str) -> int:
    if len(text.lstrip("-")) > MAX_INT_DIGITS:
        raise ValueError(f"an integer of {len(text.lstrip('-'))} digits (at most {MAX_INT_DIGITS})")
    return int(text)


def _float(text: str) -> float:
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text[:40]} is out of a double's range")
    return value


def parse_json(text: str, full: bool = False) -> Any:
    """`json.loads` with the refusals above (ValueError, its message the reason). `full`: check every
    value whatever the text holds (the reference the shortcuts agree with)."""
    long_ints = full or _LONG_RUN in text.encode("utf-8", "surrogatepass").translate(_DIGITS)
    try:
        value = json.loads(text, parse_constant=_constant, parse_int=_integer if long_ints else None,
                           parse_float=_float)  # fmt: skip
    except RecursionError:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep") from None
    if full or text.count("[") + text.count("{") > MAX_DEPTH or _may_hold_surrogates(text):
        _check(value)
    return value


def _may_hold_surrogates(text: str) -> bool:
    """Whether a string of the document may hold a surrogate: one in the text (an ASCII text, known at
    once, has none), or any \\u escape (one might be a surrogate's)."""
    return "\\u" in text or (not text.isascii() and _LONE_SURROGATE.search(text) is not None)


def _check(value: Any) -> None:
    stack = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                raise ValueError("a string holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff)")
            continue
        if isinstance(item, dict | list):
            if depth > MAX_DEPTH:
                raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
            children = [*item.keys(), *item.values()] if isinstance(item, dict) else item
            stack.extend((child, depth + 1) for child in children)


__all__ = ["MAX_DEPTH", "MAX_INT_DIGITS", "parse_json"]
