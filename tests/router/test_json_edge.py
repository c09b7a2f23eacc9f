"""The router's JSON edge (json_edge.py) and the completions prompt's validation take shortcuts where a
body cannot hold what they refuse; each answer must be the one the full checks give."""

from __future__ import annotations

import json

import pytest
from pydantic import TypeAdapter

from splitserve.router.json_edge import parse_json
from splitserve.router.openai_protocol import APIError, CompletionRequest, validate_body


def _outcome(text: str, full: bool) -> object:
    try:
        return ("ok", parse_json(text, full=full))
    except ValueError as exc:
        return ("refused", str(exc))


IDS = json.dumps({"model": "m", "prompt": list(range(3, 1091)), "max_tokens": 4, "temperature": 0.0})
BODIES = [
    IDS,
    '{"a": ' + "1" * 32 + "}",  # the longest integer allowed
    '{"a": -' + "1" * 33 + "}",  # one digit more
    '{"a": "' + "7" * 40 + '"}',  # a long run of digits in a string: no integer
    '{"a": 1.5e3, "b": [1, 2, {"c": null}]}',
    '{"a": 1e400}',
    '{"a": NaN}',
    '{"a": -Infinity}',
    '{"a": "\\ud83d\\ude00"}',  # a surrogate pair: one character
    '{"a": "x\\udfffy"}',  # a lone surrogate
    '{"\\ud800": 1}',  # a lone surrogate in a key
    '{"a": "\\\\ud800"}',  # an escaped backslash, then the letters ud800: no surrogate
    "[" * 64 + "]" * 64,
    "[" * 65 + "]" * 65,
    '{"a": "' + "[" * 80 + '"}',  # brackets in a string: not nesting
    "[" * 5000 + "]" * 5000,
]


@pytest.mark.parametrize("text", BODIES, ids=range(len(BODIES)))
def test_parse_json_answers_as_the_full_checks(text: str) -> None:
    assert _outcome(text, full=False) == _outcome(text, full=True)


def test_the_full_checks_still_refuse() -> None:
    refused = {i for i, text in enumerate(BODIES) if _outcome(text, full=False)[0] == "refused"}
    assert refused == {2, 5, 6, 7, 9, 10, 13, 15}


PROMPTS = [
    list(range(3, 1091)),
    [5],
    [1, True],
    [True],
    [1, 2.0],
    [1, "2"],
    ["a", "b"],
    [[1, 2], [3]],
    [[]],
    "text",
    [],
    [None],
    [1, [2]],
]


def _validated(prompt: object, model: bool) -> object:
    """The prompt as the request model validates it (with its shortcut), or as its declared union does."""
    try:
        if model:
            return validate_body(CompletionRequest, {"model": "m", "prompt": prompt}).prompt
        return TypeAdapter(CompletionRequest.model_fields["prompt"].annotation).validate_python(prompt)
    except APIError:
        return "refused"
    except Exception:  # noqa: BLE001 - the union's own ValidationError
        return "refused"


@pytest.mark.parametrize("prompt", PROMPTS, ids=range(len(PROMPTS)))
def test_a_prompt_validates_as_its_union_does(prompt: object) -> None:
    got, union = _validated(prompt, True), _validated(prompt, False)
    if prompt in ([], [[]]):  # the union takes them; the request refuses an empty prompt
        assert got == "refused"
        return
    assert got == union
    assert type(got) is type(union)
    if isinstance(got, list) and got:
        assert [type(x) for x in got] == [type(x) for x in union]  # ints stay ints, not bools


def test_a_token_id_prompt_is_one_prompt_of_ids() -> None:
    req = validate_body(CompletionRequest, {"model": "m", "prompt": [7, 8, 9]})
    assert req.prompts() == [[7, 8, 9]]
    req = validate_body(CompletionRequest, {"model": "m", "prompt": [[7], [8, 9]]})
    assert req.prompts() == [[7], [8, 9]]
