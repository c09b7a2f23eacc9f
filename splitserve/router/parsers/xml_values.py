"""A parameter's text in an XML tool call (`<parameter=NAME>\\nTEXT\\n</parameter>`) as the JSON value its
tool's schema declares.

The model writes every value as bare text: strings as they are, numbers and booleans as literals,
objects and arrays as JSON (Qwen's template renders earlier calls the same way). So the text alone does
not say whether `007` is a string or a number; the schema does:
  - `string`: the text as it is;
  - `integer`, `number`, `boolean`, `null`: the literal (`1`, `-2.5e3`, `true`, `null`; Python's `True`
    and `None` are taken too, as the model has seen them in code);
  - `object`, `array`: JSON, else a Python literal of dicts and lists (single quotes);
  - a union (`type: [..]`, `anyOf`, `oneOf`), or an `enum` / `const` without a type: each declared type
    in its order, `string` last, the first that reads the text wins.
A parameter the schema does not declare, or declares with no type, stays a string: without a type,
reading `007` or `true` as a number or a boolean would change a value the model meant as text, and a
tool that wants more than text declares it. Text that fits none of the declared types also stays as
written (a string), so nothing the model wrote is lost; the tool's own validation sees the mismatch.
"""

from __future__ import annotations

import ast
import json
import math
import re
from typing import Any

_INT = re.compile(r"[+-]?\d+")
_NUMBER = re.compile(r"[+-]?(?:\d+\.?\d*|\.\d+)(?:[eE][+-]?\d+)?")
_MISS = object()  # a conversion that does not apply
_JSON_TYPE = {str: "string", bool: "boolean", int: "integer", float: "number", type(None): "null",
              dict: "object", list: "array"}  # fmt: skip


def declared_types(schema: Any) -> list[str]:
    """The JSON types a parameter's schema allows, in the order it names them ([] when it says none)."""
    if not isinstance(schema, dict):
        return []
    out: list[str] = []
    kind = schema.get("type")
    out += [kind] if isinstance(kind, str) else [k for k in kind or [] if isinstance(k, str)]
    for key in ("anyOf", "oneOf", "allOf"):
        for branch in schema.get(key) or []:
            out += declared_types(branch)
    if not out and isinstance(schema.get("enum"), list):
        out = [_JSON_TYPE.get(type(v), "string") for v in schema["enum"]]
    if not out and "const" in schema:
        out = [_JSON_TYPE.get(type(schema["const"]), "string")]
    if not out and "properties" in schema:
        out = ["object"]
    if not out and "items" in schema:
        out = ["array"]
    return list(dict.fromkeys(out))


def convert(text: str, schema: Any) -> Any:
    """`text` (the blank at each end the format puts there already taken off) as its declared type."""
    types = declared_types(schema)
    for kind in types:
        if kind == "string":
            continue
        value = _READERS.get(kind, _no_reader)(text.strip())
        if value is not _MISS:
            return value
    return text


def _no_reader(_text: str) -> Any:
    return _MISS


def _integer(text: str) -> Any:
    if _INT.fullmatch(text):
        return int(text)
    number = _number(text)
    return int(number) if isinstance(number, float) and number.is_integer() else _MISS


def _number(text: str) -> Any:
    if _INT.fullmatch(text):
        return int(text)
    if _NUMBER.fullmatch(text):
        value = float(text)
        return value if math.isfinite(value) else _MISS
    return _MISS


def _boolean(text: str) -> Any:
    return {"true": True, "false": False}.get(text.lower(), _MISS)


def _null(text: str) -> Any:
    return None if text in ("null", "None") else _MISS


def _container(kind: type) -> Any:
    def read(text: str) -> Any:
        try:
            value = json.loads(text)
        except ValueError:
            try:
                value = ast.literal_eval(text)
                json.dumps(value)  # only what JSON can hold (no tuples as keys, no sets)
            except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                return _MISS
        return value if isinstance(value, kind) else _MISS

    return read


_READERS = {"integer": _integer, "number": _number, "boolean": _boolean, "null": _null,
            "object": _container(dict), "array": _container(list)}  # fmt: skip

__all__ = ["convert", "declared_types"]
