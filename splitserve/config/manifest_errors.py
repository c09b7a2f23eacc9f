"""A manifest that does not validate: `ManifestError`, and each problem described by its YAML path and
line, with what to write instead (a close field name for a typo, the allowed values of a literal)."""

from __future__ import annotations

import difflib
from typing import Any

import yaml
from pydantic import BaseModel


class ManifestError(ValueError):
    """A manifest that does not validate; the message lists every problem with its YAML path."""

    def __init__(self, source: str, problems: list[str]) -> None:
        self.source = source
        self.problems = problems
        super().__init__(f"invalid manifest {source}:\n" + "\n".join(f"  - {p}" for p in problems))


def describe(err: Any, root: yaml.Node | None, model: type[BaseModel]) -> str:
    """One validation error as `path (line N): what is wrong; what to write instead`."""
    loc = [str(p) for p in err["loc"]]
    path = ".".join(loc) or "(top level)"
    where = _line(root, err["loc"])
    at = f" (line {where})" if where else ""
    kind, msg = err["type"], err["msg"]
    if kind == "extra_forbidden":
        known = _known_fields(model, err["loc"][:-1])
        close = difflib.get_close_matches(loc[-1], known, n=1)
        hint = f"did you mean '{close[0]}'?" if close else f"known fields here: {', '.join(sorted(known))}"
        return f"{path}{at}: unknown field; {hint}"
    if kind == "literal_error":
        return f"{path}{at}: {msg.replace('Input should be', 'must be')} (got {_short(err.get('input'))})"
    msg = msg.removeprefix("Value error, ")
    return f"{path}{at}: {msg} (got {_short(err.get('input'))})"


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 120 else text[:117] + "..."


def _known_fields(model: type[BaseModel], loc: tuple) -> list[str]:
    for key in loc:
        field = model.model_fields.get(str(key))
        ann = getattr(field, "annotation", None) if field else None
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def _line(root: yaml.Node | None, loc: tuple) -> int | None:
    """The 1-based line of the deepest node of `loc` found in the YAML (None if it is not there)."""
    node, line = root, None
    for key in loc:
        if isinstance(node, yaml.MappingNode):
            nxt = next((v for k, v in node.value if getattr(k, "value", None) == str(key)), None)
            if nxt is None:
                return line
            node = nxt
        elif isinstance(node, yaml.SequenceNode) and isinstance(key, int) and key < len(node.value):
            node = node.value[key]
        else:
            break
        line = node.start_mark.line + 1
    return line


__all__ = ["ManifestError", "describe"]
