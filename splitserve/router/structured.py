"""Structured outputs in the router: a request's `response_format` or vLLM's guided fields -> the
`GrammarSpec` its sampling params carry to the workers, checked here so that a bad one is a 400.

OpenAI's `response_format`: `text`, `json_object` (any JSON object), `json_schema` (`json_schema.schema`,
`strict`). vLLM's extras, on chat and completions alike: `structured_outputs` ({json | regex | choice |
grammar | json_object | structural_tag}) and the older `guided_json`, `guided_regex`, `guided_choice`,
`guided_grammar`. At most one of them per request. The grammar is compiled by each engine
(engine/grammar.py); here it is checked against the manifest's limits (`server.structured`,
sampling/grammar_limits.py: enum and choice counts, nesting, size, regex repetition) and parsed, off the
event loop and cached per spec, so that a costly or bad one is a 400 before anything is queued.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import asdict
from typing import Any

from splitserve.router.openai_protocol import APIError, JSONSchemaFormat, StructuredOutputs
from splitserve.sampling.grammar_check import GrammarError, check_grammar
from splitserve.sampling.grammar_limits import (
    GrammarLimitError,
    GrammarLimits,
    check_limits,
    check_regex,
    check_schema,
)
from splitserve.sampling.params import GrammarSpec


def _json_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as exc:
            raise APIError(400, f"{param}: not valid JSON: {exc}", param=param) from None
    if not isinstance(schema, (dict, bool)):
        raise APIError(400, f"{param}: a JSON schema must be an object", param=param)
    return json.dumps(schema)


def requested_grammar(req: Any, limits: GrammarLimits | None = None) -> tuple[GrammarSpec, str] | None:
    """The grammar a request asks for and the field that asked, or None; 400 for two at once, or for
    one past `limits` (counted on the parsed body, before a costly spec is serialized)."""
    try:
        return _requested(req, limits or GrammarLimits())
    except GrammarLimitError as exc:
        raise APIError(400, str(exc), param=exc.param, code="grammar_too_complex") from None


def _requested(req: Any, limits: GrammarLimits) -> tuple[GrammarSpec, str] | None:
    found: list[tuple[GrammarSpec, str]] = []
    fmt = getattr(req, "response_format", None)
    if fmt is not None and fmt.get("type", "text") != "text":
        found.append(_response_format(fmt, limits))
    so: StructuredOutputs | None = req.structured_outputs
    if so is not None:
        picks = [(k, v) for k, v in so.model_dump(by_alias=True).items() if v not in (None, False)]
        if len(picks) != 1:
            raise APIError(400, "structured_outputs: give exactly one of json, regex, choice, grammar, "
                           "json_object, structural_tag", param="structured_outputs")  # fmt: skip
        found.append(_spec(picks[0][0], picks[0][1], f"structured_outputs.{picks[0][0]}", limits))
    for key, kind in (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
                      ("guided_grammar", "grammar")):  # fmt: skip
        value = getattr(req, key)
        if value is not None:
            found.append(_spec(kind, value, key, limits))
    if len(found) > 1:
        names = ", ".join(p for _, p in found)
        raise APIError(400, f"ask for one structured output at a time, not {names}", param=found[1][1])
    return found[0] if found else None


def _response_format(fmt: dict[str, Any], limits: GrammarLimits) -> tuple[GrammarSpec, str]:
    kind = fmt.get("type")
    if kind == "json_object":
        return GrammarSpec("json_object"), "response_format"
    if kind != "json_schema":
        raise APIError(400, f"response_format.type must be text, json_object or json_schema, not {kind!r}",
                       param="response_format.type")  # fmt: skip
    where = "response_format.json_schema"
    try:
        body = JSONSchemaFormat.model_validate(fmt.get("json_schema") or {})
    except ValueError as exc:
        raise APIError(400, f"{where}: {exc}", param=where) from None
    if body.schema_ is None:
        raise APIError(400, f"{where}.schema is required", param=where)
    check_schema(body.schema_, f"{where}.schema", limits)
    schema = _json_text(body.schema_, "response_format.json_schema.schema")
    return GrammarSpec("json", schema, strict=body.strict is not False), f"{where}.schema"


def _spec(kind: str, value: Any, param: str, limits: GrammarLimits) -> tuple[GrammarSpec, str]:
    if kind == "json" and not isinstance(value, str):
        check_schema(value, param, limits)
    if kind == "choice" and isinstance(value, list) and len(value) > limits.max_choices:
        raise GrammarLimitError(param, "max_choices", f"{len(value)} entries, more than the "
                                f"{limits.max_choices} allowed")  # fmt: skip
    if kind == "regex" and isinstance(value, str):
        check_regex(value, param, limits)
    if kind == "json":
        return GrammarSpec("json", _json_text(value, param)), param  # strict, as vLLM compiles it
    if kind == "json_object":
        return GrammarSpec("json_object"), param
    if kind == "choice":
        if not isinstance(value, list) or not value or not all(isinstance(c, str) and c for c in value):
            raise APIError(400, f"{param}: a non-empty list of non-empty strings", param=param)
        return GrammarSpec("choice", json.dumps(value)), param
    if not isinstance(value, str) or not value:
        raise APIError(400, f"{param}: a non-empty string", param=param)
    return GrammarSpec("ebnf" if kind == "grammar" else kind, value), param


async def checked(spec: GrammarSpec, param: str, limits: GrammarLimits) -> dict[str, Any]:
    """The spec as sampling params carry it, once it is within `limits` and parses; else a 400 naming
    the limit or the problem."""
    try:
        await asyncio.to_thread(_check, spec, param, limits)
    except GrammarLimitError as exc:
        raise APIError(400, str(exc), param=exc.param, code="grammar_too_complex") from None
    except GrammarError as exc:
        raise APIError(400, f"{param}: {exc}", param=param, code="invalid_grammar") from None
    return asdict(spec)


def _check(spec: GrammarSpec, param: str, limits: GrammarLimits) -> None:
    check_limits(spec, param, limits)
    check_grammar(spec)


def check_tool_limits(tools: list[dict], limits: GrammarLimits) -> None:
    """The forced tools' parameter schemas within `limits` (a 400 naming the tool's field)."""
    for i, tool in enumerate(tools):
        schema = (tool.get("function") or {}).get("parameters")
        try:
            check_schema(schema, f"tools[{i}].function.parameters", limits)
        except GrammarLimitError as exc:
            raise APIError(400, str(exc), param=exc.param, code="grammar_too_complex") from None


__all__ = ["check_tool_limits", "checked", "requested_grammar"]
