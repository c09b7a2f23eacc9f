"""The HTTP edge's JSON: parsed strictly, so that a request's shape cannot reach the code behind it
as a 500.

Refused (each a ValueError with the reason, answered 400 by the caller):
  NaN / Infinity      not JSON (Python's json accepts them; OpenAI's API does not)
  huge numbers        integers of more than MAX_INT_DIGITS digits (Python would refuse them later, as
                      a 500), floats beyond a double's range (1e400 would read as Infinity)
  deep nesting        more than MAX_DEPTH levels of arrays and objects
  lone surrogates     "\\ud800" escapes without their pair: not text, and not encodable as UTF-8
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

MAX_DEPTH = 64
MAX_INT_DIGITS = 32
_LONE_SURROGATE = re.compile("[\ud800-\udfff]")


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


def parse_json(text: str) -> Any:
    """`json.loads` with the refusals above (ValueError, its message the reason)."""
    try:
        value = json.loads(text, parse_constant=_constant, parse_int=_integer, parse_float=_float)
    except RecursionError:
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep") from None
    _check(value)
    return value


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
