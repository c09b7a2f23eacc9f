"""Whether a grammar spec parses, without a tokenizer: the router and the worker front end call
`check_grammar` to answer a bad schema, regex or grammar with a 400 before anything reaches an engine;
the engine compiles a spec with `build_grammar` (engine/grammar.py). Needs xgrammar (imported when a
spec is first built), not torch or the engine.
"""

from __future__ import annotations

import functools
import json
from typing import TYPE_CHECKING

from splitserve.sampling.params import GrammarSpec

if TYPE_CHECKING:
    import xgrammar


class GrammarError(ValueError):
    """A spec that does not parse: the message names the problem (xgrammar's words)."""


def build_grammar(spec: GrammarSpec) -> xgrammar.Grammar:
    """The xgrammar `Grammar` of a spec (no tokenizer needed). Raises GrammarError."""
    import xgrammar as xgr

    try:
        if spec.kind == "json":
            return xgr.Grammar.from_json_schema(spec.spec, any_whitespace=False, strict_mode=spec.strict)
        if spec.kind == "json_object":
            return xgr.Grammar.from_json_schema('{"type": "object"}', any_whitespace=False, strict_mode=False)
        if spec.kind == "regex":
            return xgr.Grammar.from_regex(spec.spec)
        if spec.kind == "choice":
            return xgr.Grammar.from_ebnf(_choice_ebnf(spec.spec))
        if spec.kind == "ebnf":
            return xgr.Grammar.from_ebnf(spec.spec)
        return xgr.Grammar.from_structural_tag(spec.spec)
    except GrammarError:
        raise
    except Exception as exc:  # noqa: BLE001 - xgrammar raises RuntimeError, ValueError, pydantic errors
        raise GrammarError(f"invalid {spec.kind} grammar: {clean_error(exc)}") from None


@functools.lru_cache(maxsize=1024)
def _check(kind: str, spec: str, strict: bool) -> str | None:
    try:
        build_grammar(GrammarSpec(kind, spec, strict))
    except GrammarError as exc:
        return str(exc)
    return None


def check_grammar(spec: GrammarSpec) -> None:
    """Raise GrammarError if `spec` does not parse (the verdict is cached per spec)."""
    problem = _check(*spec.key)
    if problem is not None:
        raise GrammarError(problem)


def _choice_ebnf(spec: str) -> str:
    try:
        choices = json.loads(spec)
    except ValueError:
        choices = None
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise GrammarError("a choice grammar needs a non-empty list of non-empty strings")
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


def clean_error(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location prefix ("[hh:mm:ss] file.cc:123: ")."""
    text = str(exc).strip()
    if text.startswith("[") and ": " in text:
        head, _, rest = text.partition(": ")
        if ".cc:" in head or ".h:" in head:
            return rest.strip()
    return text.splitlines()[0] if text else type(exc).__name__


__all__ = ["GrammarError", "build_grammar", "check_grammar", "clean_error"]
