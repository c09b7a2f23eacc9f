"""Static limits on a grammar's size and shape, checked before anything is queued: the router refuses a
spec past one with a 400 that names the limit and the field, so a costly grammar never reaches a worker.

Why these: xgrammar's compile time grows faster than linearly in the alternatives it must merge (on one
core, a 10,000-value `enum` compiles in 0.06 s, a 100,000-value one in 53 s and a 100,000-entry choice
in 28 s), and a regex whose repeated group holds an unbounded quantifier (`^(a*)*(a*)*$`, star height 2)
makes every later token's mask slower (0.2 s a step after 300 tokens), in the step of every request
batched beside it. Repetition bounds and pattern lengths are capped so that a regex stays small text.

    GrammarLimits            the limits (manifest: `server.structured`, config/manifest_limits.py)
    check_limits(spec, ...)  raise GrammarLimitError for a spec past one (json, regex, choice, ebnf, tags)
    check_schema(...)        the same walk over a JSON schema given as an object (tool parameters)
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from splitserve.sampling.params import GrammarSpec


@dataclass(frozen=True)
class GrammarLimits:
    max_enum_values: int = 1000  # enum values and consts in one JSON schema, all counted
    max_choices: int = 1000  # entries of a choice (guided_choice, structured_outputs.choice)
    max_schema_depth: int = 64  # objects and arrays nested in a JSON schema document
    max_schema_bytes: int = 128 << 10  # a schema's, EBNF grammar's or structural tag's text
    max_pattern_chars: int = 4096  # a regex: guided_regex, or a schema's `pattern`
    max_repetition: int = 10_000  # a regex's repetition bound, {n} or {n,m}
    allow_nested_quantifiers: bool = False  # `(a+)+`: a repeated group holding an unbounded repeat


class GrammarLimitError(ValueError):
    """A spec past a limit: `limit` names it (as the manifest spells it), `param` the field."""

    def __init__(self, param: str, limit: str, message: str) -> None:
        super().__init__(f"{param}: {message} (the limit is server.structured.{limit})")
        self.param, self.limit = param, limit


def check_limits(spec: GrammarSpec, param: str, limits: GrammarLimits) -> None:
    """Raise GrammarLimitError if `spec` (asked for in the request's field `param`) is past a limit."""
    if spec.kind == "choice":
        try:
            n = len(json.loads(spec.spec))
        except (ValueError, TypeError):
            n = 0
        _at_most(n, limits.max_choices, param, "max_choices", "entries")
    if spec.kind == "regex":
        check_regex(spec.spec, param, limits)
        return
    if spec.kind == "json":  # its counts first: they name the problem better than its size
        try:
            check_schema(json.loads(spec.spec), param, limits)
        except ValueError as exc:
            if isinstance(exc, GrammarLimitError):
                raise
            # not JSON: the parse check answers it
    _at_most(len(spec.spec.encode()), limits.max_schema_bytes, param, "max_schema_bytes", "bytes")


def check_schema(schema: Any, param: str, limits: GrammarLimits) -> None:
    """Walk a JSON schema (parsed) without recursion: nesting depth, enum and const values, and each
    `pattern` (and `patternProperties` key) as a regex."""
    enum_values = 0
    stack: list[tuple[Any, int, str]] = [(schema, 1, param)]
    while stack:
        node, depth, where = stack.pop()
        if depth > limits.max_schema_depth:
            deeper = f"the schema nests deeper than {limits.max_schema_depth} levels"
            raise GrammarLimitError(param, "max_schema_depth", deeper)
        if isinstance(node, list):
            stack.extend((v, depth + 1, where) for v in node if isinstance(v, (dict, list)))
            continue
        if not isinstance(node, dict):
            continue
        enum = node.get("enum")
        enum_values += len(enum) if isinstance(enum, list) else 0
        enum_values += 1 if "const" in node else 0
        _at_most(enum_values, limits.max_enum_values, param, "max_enum_values", "enum and const values")
        if isinstance(node.get("pattern"), str):
            check_regex(node["pattern"], f"{where}.pattern", limits)
        props = node.get("patternProperties")
        for key in props if isinstance(props, dict) else ():
            check_regex(key, f"{where}.patternProperties", limits)
        for key, value in node.items():
            if key not in ("enum", "const", "default", "examples") and isinstance(value, (dict, list)):
                stack.append((value, depth + 1, f"{where}.{key}" if key != "properties" else where))


_BRACE = re.compile(r"\{(\d+)(,(\d*))?\}")


def check_regex(pattern: str, param: str, limits: GrammarLimits) -> None:
    """Length, repetition bounds and (unless allowed) nested quantifiers of a regex.

    One pass over the pattern, escapes and character classes skipped: each open group remembers whether
    it holds an unbounded quantifier (`*`, `+`, `{n,}`); a group that does, repeated more than once by
    its own quantifier, is a nested quantifier."""
    _at_most(len(pattern), limits.max_pattern_chars, param, "max_pattern_chars", "characters")
    groups = [False]  # per open group: holds an unbounded quantifier
    last: bool | None = None  # the atom before: None (none), False (plain), True (a group holding one)
    i, n = 0, len(pattern)
    while i < n:
        c = pattern[i]
        if c == "\\":
            i, last = i + 2, False
        elif c == "[":
            i, last = _class_end(pattern, i), False
        elif c == "(":
            groups.append(False)
            i, last = _group_body(pattern, i + 1), None
        elif c == ")":
            inner = groups.pop() if len(groups) > 1 else False
            groups[-1] |= inner
            i, last = i + 1, inner
        elif c == "|":
            i, last = i + 1, None
        elif c in "*+?" or (c == "{" and _BRACE.match(pattern, i)):
            i, unbounded, repeats = _quantifier(pattern, i, param, limits)
            if last and repeats and not limits.allow_nested_quantifiers:
                raise GrammarLimitError(param, "allow_nested_quantifiers",
                                        "a repeated group holds an unbounded quantifier (like (a+)+), "
                                        "which makes matching costly")  # fmt: skip
            groups[-1] |= unbounded
            last = False
        else:
            i, last = i + 1, False


def _quantifier(pattern: str, i: int, param: str, limits: GrammarLimits) -> tuple[int, bool, bool]:
    """-> (index after it and its lazy/possessive mark, unbounded?, may repeat more than once?)."""
    c = pattern[i]
    if c == "{":
        m = _BRACE.match(pattern, i)
        assert m is not None
        low, comma, high = int(m.group(1)), m.group(2), m.group(3)
        top = max(low, int(high)) if high else low
        _at_most(top, limits.max_repetition, param, "max_repetition", "as a repetition bound")
        unbounded, repeats, i = bool(comma) and not high, bool(comma and not high) or top > 1, m.end()
    else:
        unbounded, repeats, i = c != "?", c != "?", i + 1
    if i < len(pattern) and pattern[i] in "?+":
        i += 1
    return i, unbounded, repeats


def _class_end(pattern: str, i: int) -> int:
    """The index after the character class opening at `i` (`[`): `]` first (or after `^`) is literal."""
    j = i + 1
    if j < len(pattern) and pattern[j] == "^":
        j += 1
    if j < len(pattern) and pattern[j] == "]":
        j += 1
    while j < len(pattern) and pattern[j] != "]":
        j += 2 if pattern[j] == "\\" else 1
    return j + 1


def _group_body(pattern: str, i: int) -> int:
    """Past a group's `?:`, `?=`, `?!`, `?<=`, `?<!` or `?<name>` prefix (its `?` is no quantifier)."""
    if i < len(pattern) and pattern[i] == "?":
        if pattern.startswith(("?<=", "?<!"), i):
            return i + 3
        if pattern.startswith(("?<", "?P<"), i):
            end = pattern.find(">", i)
            return end + 1 if end > 0 else len(pattern)
        return i + 2
    return i


def _at_most(value: int, limit: int, param: str, name: str, what: str) -> None:
    if value > limit:
        raise GrammarLimitError(param, name, f"{value} {what}, more than the {limit} allowed")


__all__ = ["GrammarLimitError", "GrammarLimits", "check_limits", "check_regex", "check_schema"]
