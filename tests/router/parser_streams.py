"""Checks shared by the parser tests: one scripted answer parsed whole, and streamed split at every
character boundary (each single split point, and one character per delta), the joined OpenAI deltas
equal to the whole parse."""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from splitserve.router.parsers import ChatOutput, Parsed


def joined(deltas: list[dict[str, Any]]) -> dict[str, Any]:
    """A stream's chat deltas as one message, checking OpenAI's shape on the way: each call announced
    once (id, type, name, arguments "") before any fragment of its arguments, indexes in order."""
    content, reasoning, calls = "", "", {}
    for d in deltas:
        assert set(d) <= {"content", "reasoning_content", "reasoning", "tool_calls"}, d
        content += d.get("content", "")
        reasoning += d.get("reasoning_content", "")
        assert d.get("reasoning") == d.get("reasoning_content"), d
        for tc in d.get("tool_calls", []):
            index = tc["index"]
            if "id" in tc:
                assert index == len(calls) and tc["type"] == "function", tc
                assert tc["function"]["arguments"] == "", tc
                calls[index] = [tc["id"], tc["function"]["name"], ""]
            else:
                assert index in calls and set(tc) == {"index", "function"}, tc
                calls[index][2] += tc["function"]["arguments"]
    return {"content": content or None, "reasoning": reasoning or None,
            "calls": [(name, args) for _, name, args in calls.values()]}  # fmt: skip


def whole(parsed: Parsed) -> dict[str, Any]:
    return {"content": parsed.content, "reasoning": parsed.reasoning,
            "calls": [(c.name, c.arguments) for c in parsed.calls]}  # fmt: skip


def check_streams(make: Callable[[], ChatOutput], text: str) -> Parsed:
    """`text` parsed whole; every split of it streamed gives the same message. -> the whole parse."""
    parsed = make().parse(text)
    expected = whole(parsed)
    for cut in range(len(text) + 1):
        out = make()
        deltas = out.deltas(text[:cut], False) + out.deltas(text[cut:], True)
        assert joined(deltas) == expected, f"split at {cut}: {text[:cut]!r} | {text[cut:]!r}"
    out = make()
    deltas = [d for ch in text for d in out.deltas(ch, False)] + out.deltas("", True)
    assert joined(deltas) == expected, "one character per delta"
    for call in parsed.calls:
        json.loads(call.arguments)  # every call's arguments are JSON, cut or not
    return parsed


def args(parsed: Parsed) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in parsed.calls]
