"""Request fields the server does not know, accepted and ignored as vLLM does (a warning line and a
counter), or refused with a 400 when `server.reject_unknown_fields` is set.

Clients send vendor extras (a provider's `cache_control` on a message part, an SDK's tracing fields):
vLLM's request models allow them, log "fields were present in the request but ignored" and go on. Here
the request models stay strict (pydantic `extra="forbid"`, so a misspelt known field is still named),
and `validate_request` removes the unknown fields the validation names, then validates again. Each
ignored field is counted in `splitserve:ignored_request_fields_total{field}`, its path with list
positions as `*` (`messages.*.content.*.cache_control`), so the label set stays small.
"""

from __future__ import annotations

import copy
import logging
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from pydantic import ValidationError

from splitserve.router.openai_protocol import validate_body

log = logging.getLogger("splitserve.router.server")
_ROUNDS = 8  # validations at most: the unknown fields of nested models come out a level at a time


def ignored_fields_counter(registry: CollectorRegistry) -> Counter:
    return Counter(
        "splitserve:ignored_request_fields",
        "Request fields the server does not know, ignored (server.reject_unknown_fields: false)",
        ["model_name", "field"],
        registry=registry,
    )


def validate_request(server: Any, model: type, body: dict) -> Any:
    """`validate_body(model, body)`, ignoring the fields `model` does not know unless the manifest
    asks for strictness. Raises APIError (400) for every other problem, as validate_body does."""
    if server.manifest.server.reject_unknown_fields:
        return validate_body(model, body)
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
    work, ignored = body, []
    for _ in range(_ROUNDS):
        extra = [e["loc"] for e in errors if e["type"] == "extra_forbidden"]
        if not extra:
            break
        if work is body:
            work = copy.deepcopy(body)  # the caller's body stays as sent
        removed = [path for path in (_remove(work, loc) for loc in extra) if path is not None]
        if not removed:
            break
        ignored += removed
        try:
            req = model.model_validate(work)
        except ValidationError as exc:
            errors = exc.errors()
            continue
        _report(server, sorted(set(ignored)))
        return req
    return validate_body(model, work)  # what is wrong besides unknown fields, as a 400


def _remove(body: Any, loc: tuple) -> str | None:
    """Delete the field at `loc` (pydantic's error location; union member tags in it are skipped).
    -> its path with list positions as `*`, or None when `loc` does not lead to a key of `body`."""
    node, path = body, []
    for i, part in enumerate(loc):
        last = i == len(loc) - 1
        if isinstance(node, dict) and isinstance(part, str) and part in node:
            if last:
                del node[part]
                return ".".join([*path, part])
            node, path = node[part], [*path, part]
        elif isinstance(node, list) and isinstance(part, int) and 0 <= part < len(node):
            node, path = node[part], [*path, "*"]
        elif last:
            return None
        # else: a union member's tag (`list[TextPart]`, `function-after[...]`): not in the body
    return None


def _report(server: Any, fields: list[str]) -> None:
    log.warning("The following fields were present in the request but ignored: %s", fields)
    counter, name = server.ignored_fields, server.info.served_name
    for field in fields:
        counter.labels(name, field).inc()


__all__ = ["ignored_fields_counter", "validate_request"]
