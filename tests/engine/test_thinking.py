"""An answer that starts inside a thinking block (`SamplingParams.thinking`, engine/thinking.py), on a
random-weight chat-vocabulary tiny model: the grammar constrains only what follows the block's end; a
budget forces the end after that many thinking tokens; a decode engine that adopts the prefill's first
token is in the prefill's state; overlapped steps give the same tokens."""

from __future__ import annotations

import json

import jsonschema
import msgspec
import pytest

from splitserve import LLM, SamplingParams
from splitserve.sampling.params import GrammarSpec, ThinkingSpec

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "k": {"enum": ["x", "y"]}},
    "required": ["n", "k"],
}
SPEC = GrammarSpec("json", json.dumps(SCHEMA))
PROMPT = [11, 12, 13]
KW = {"model": "random:tiny-chat", "max_model_len": 512, "kv_cache_bytes": 16 << 20, "progress": False}


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(**KW)


@pytest.fixture(scope="module")
def end_ids(llm) -> tuple[int, ...]:
    return tuple(llm.engine.tokenizer.encode("</think>", add_special_tokens=False))


def tokens(llm: LLM, params: SamplingParams, prompt: list[int] = PROMPT) -> list[int]:
    (out,) = llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return list(out.outputs[0].token_ids)


def answer(llm: LLM, ids: list[int]) -> str:
    return llm.engine.tokenizer.decode(ids)


@pytest.mark.parametrize("budget", [0, 1, 7])
def test_a_budget_forces_the_end_then_the_grammar_holds_the_answer(llm, end_ids, budget):
    """Greedy: `budget` free tokens (those the model writes unconstrained), then the end forced token for
    token, then an answer valid against the schema."""
    free = tokens(llm, SamplingParams(temperature=0, max_tokens=budget + 1, ignore_eos=True))[:budget]
    thinking = ThinkingSpec(end=end_ids, budget=budget)
    got = tokens(llm, SamplingParams(temperature=0, max_tokens=80, grammar=SPEC, thinking=thinking))
    head = budget + len(end_ids)
    assert got[:budget] == free and tuple(got[budget:head]) == end_ids
    jsonschema.validate(json.loads(answer(llm, got[head:])), SCHEMA)


def test_the_grammar_waits_for_the_end_the_model_writes(llm):
    """The model's own first token taken as the block's end: the block ends there unforced, and the
    grammar holds every token after it (not the first: unconstrained, it is no JSON's first token)."""
    first = tokens(llm, SamplingParams(temperature=0, max_tokens=1))[0]
    assert not answer(llm, [first]).lstrip().startswith("{")
    got = tokens(llm, SamplingParams(temperature=0, max_tokens=80, grammar=SPEC,
                                     thinking=ThinkingSpec(end=(first,))))  # fmt: skip
    assert got[0] == first
    jsonschema.validate(json.loads(answer(llm, got[1:])), SCHEMA)


def test_a_budget_without_a_grammar(llm, end_ids):
    """Only the budget: the end forced after 3 tokens, then the answer runs free as the model writes it
    (the same tokens as the model given that thinking in its prompt)."""
    params = SamplingParams(
        temperature=0, max_tokens=12, ignore_eos=True, thinking=ThinkingSpec(end_ids, budget=3)
    )
    got = tokens(llm, params)
    assert tuple(got[3 : 3 + len(end_ids)]) == end_ids
    head = 3 + len(end_ids)
    rest = tokens(
        llm, SamplingParams(temperature=0, max_tokens=12 - head, ignore_eos=True), PROMPT + got[:head]
    )
    assert got[head:] == rest


def test_a_block_the_model_opens_itself_is_bounded_and_one_it_does_not_open_is_not(llm, end_ids):
    """`start`: the model's own first tokens open the block (greedy's first token stands for `<think>`
    here); 3 thinking tokens after it, then the end forced. A `start` the answer does not begin with
    leaves the answer as the model writes it."""
    free = tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
    opened = ThinkingSpec(end_ids, budget=3, start=(free[0],))
    got = tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, thinking=opened))
    assert got[:4] == free[:4] and tuple(got[4 : 4 + len(end_ids)]) == end_ids
    other = ThinkingSpec(end_ids, budget=0, start=(free[0] + 1,))
    assert tokens(llm, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, thinking=other)) == free


def test_forced_text_other_than_the_end(llm, end_ids):
    forced = tuple(llm.engine.tokenizer.encode("\n</think>\n\n", add_special_tokens=False))
    params = SamplingParams(temperature=0, max_tokens=60, grammar=SPEC,
                            thinking=ThinkingSpec(end_ids, forced=forced, budget=2))  # fmt: skip
    got = tokens(llm, params)
    assert tuple(got[2 : 2 + len(forced)]) == forced
    jsonschema.validate(json.loads(answer(llm, got[2 + len(forced) :])), SCHEMA)


@pytest.mark.parametrize("budget", [0, 4])
def test_an_adopted_first_token_puts_the_decode_side_in_the_prefill_state(llm, end_ids, budget):
    """The decode side's path: the first token sampled elsewhere, replayed into a fresh gate and matcher;
    the rest equals the request run whole in one engine."""
    params = SamplingParams(
        temperature=0, max_tokens=60, grammar=SPEC, thinking=ThinkingSpec(end_ids, budget=budget)
    )
    whole = tokens(llm, params)
    engine = llm.engine
    port = engine.transfers.port  # what a KV import does to the engine (kv_transfer_port.py)
    req = port.build_request(PROMPT, params, f"adopted-{budget}")
    port.adopt(req, whole[0], None, 0)
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids == whole


@pytest.mark.parametrize("k", [2, 6, 14])
def test_a_resumed_constrained_answer_goes_on_as_one_run(llm, end_ids, k):
    """A migrated request (`resumed`): its earlier output, in its prompt, moves the gate and the grammar's
    matcher on (inside the thinking, at its forced end, inside the JSON), and the rest is the whole run's."""
    params = SamplingParams(
        temperature=0, max_tokens=60, grammar=SPEC, thinking=ThinkingSpec(end_ids, budget=4)
    )
    whole = tokens(llm, params)
    rest = tokens(llm, msgspec.structs.replace(params, max_tokens=60 - k, resumed=k), PROMPT + whole[:k])
    assert rest == whole[k:]


def test_a_resumed_answer_its_grammar_refuses_is_an_error_and_holds_nothing(llm):
    params = SamplingParams(temperature=0, max_tokens=8, grammar=SPEC, resumed=2)
    bad = llm.engine.tokenizer.encode("no", add_special_tokens=False)[:1] * 2  # not a JSON object's start
    with pytest.raises(ValueError, match="not in its grammar"):
        tokens(llm, params, PROMPT + bad)
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_overlapped_steps_give_the_same_tokens(end_ids):
    plain, overlapped = LLM(**KW, async_scheduling=False), LLM(**KW, async_scheduling=True)
    params = [
        SamplingParams(temperature=0, max_tokens=50, grammar=SPEC, thinking=ThinkingSpec(end_ids, budget=5)),
        SamplingParams(temperature=0.8, seed=2, max_tokens=40, thinking=ThinkingSpec(end_ids, budget=9)),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
    ]
    prompts = [{"prompt_token_ids": [11 + i, 12, 13]} for i in range(len(params))]

    def run(llm: LLM) -> list[list[int]]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks
        return [list(o.outputs[0].token_ids) for o in outs]

    assert run(overlapped) == run(plain) and overlapped.engine.overlapped_steps > 5


def test_bad_thinking_specs_are_refused():
    with pytest.raises(ValueError, match="token ids"):
        SamplingParams(thinking={"end": []})
    with pytest.raises(ValueError, match="budget"):
        SamplingParams(thinking={"end": [5], "budget": -1})
    assert SamplingParams(thinking={"end": [5, 6], "budget": 3}).thinking == ThinkingSpec((5, 6), (5, 6), 3)
