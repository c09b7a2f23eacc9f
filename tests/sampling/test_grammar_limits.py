"""The static grammar limits (sampling/grammar_limits.py): hostile specs are refused naming the limit and
the field; ordinary ones (the structured-output tests' schemas and patterns) pass."""

from __future__ import annotations

import json

import pytest

from splitserve.sampling.grammar_limits import GrammarLimitError, GrammarLimits, check_limits, check_regex
from splitserve.sampling.params import GrammarSpec

LIMITS = GrammarLimits()


def _refused(spec: GrammarSpec, param: str = "f", limits: GrammarLimits = LIMITS) -> GrammarLimitError:
    with pytest.raises(GrammarLimitError) as err:
        check_limits(spec, param, limits)
    return err.value


@pytest.mark.parametrize(
    "spec, limit",
    [
        (GrammarSpec("json", json.dumps({"enum": list(range(100_000))})), "max_enum_values"),
        (GrammarSpec("json", json.dumps({"anyOf": [{"const": i} for i in range(1001)]})), "max_enum_values"),
        (GrammarSpec("choice", json.dumps([f"c{i}" for i in range(100_000)])), "max_choices"),
        (GrammarSpec("regex", "^(a+)+$"), "allow_nested_quantifiers"),
        (GrammarSpec("regex", "^(a*)*(a*)*$"), "allow_nested_quantifiers"),
        (GrammarSpec("regex", "^(?:x|(b{2,})){3}$"), "allow_nested_quantifiers"),
        (GrammarSpec("regex", "^a{1000000}$"), "max_repetition"),
        (GrammarSpec("regex", "^a{2,1000000}$"), "max_repetition"),
        (GrammarSpec("regex", "a" * 5000), "max_pattern_chars"),
        (GrammarSpec("ebnf", "root ::= " + " | ".join(f'"{i}"' for i in range(30_000))), "max_schema_bytes"),
    ],
)
def test_hostile_specs_name_their_limit(spec, limit):
    err = _refused(spec, "guided_x")
    assert err.limit == limit and err.param == "guided_x"
    assert f"server.structured.{limit}" in str(err) and str(err).startswith("guided_x: ")


def test_deep_schema_and_its_pattern_name_the_field():
    deep: dict = {"type": "string"}
    for _ in range(40):
        deep = {"type": "object", "properties": {"a": deep}}
    assert _refused(GrammarSpec("json", json.dumps(deep))).limit == "max_schema_depth"
    schema = {"type": "object", "properties": {"code": {"type": "string", "pattern": "^(\\d+)+$"}}}
    err = _refused(GrammarSpec("json", json.dumps(schema)), "response_format.json_schema.schema")
    assert err.param == "response_format.json_schema.schema.code.pattern"


@pytest.mark.parametrize(
    "pattern",
    ["[0-9]{3}-[a-c]{2}", "a{200}", "(ab)+", "(\\d{3}-)+\\d", "[(a+)+]", "\\(a+\\)+", "(?:ab)*c?",
     "^[a-z]+(?:-[a-z]+)?$", "(a|b)+", "x{2,5}(y){1,3}", "[]a+]+"],
)  # fmt: skip
def test_ordinary_patterns_pass(pattern):
    check_regex(pattern, "f", LIMITS)


def test_limits_are_settable():
    loose = GrammarLimits(
        max_enum_values=200_000, allow_nested_quantifiers=True, max_repetition=10**7, max_schema_bytes=1 << 20
    )
    check_limits(GrammarSpec("json", json.dumps({"enum": list(range(100_000))})), "f", loose)
    check_limits(GrammarSpec("regex", "^(a+)+$"), "f", loose)
    check_limits(GrammarSpec("regex", "^a{1000000}$"), "f", loose)
    assert _refused(GrammarSpec("choice", '["a", "b", "c"]'), limits=GrammarLimits(max_choices=2)).limit


def test_the_manifest_section_sets_them():
    from splitserve.config.manifest import Manifest

    m = Manifest.model_validate({"server": {"structured": {"max_choices": 5, "compile_timeout_s": 2}}})
    assert m.server.structured.limits().max_choices == 5
    assert m.server.structured.limits().max_enum_values == LIMITS.max_enum_values
