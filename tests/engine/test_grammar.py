"""Grammar-constrained decoding in the engine (engine/grammar.py), on a random-weight chat-vocabulary
tiny model: a compile never stalls the other requests, an abort while compiling frees everything, the
prefill/decode replay gives the same tokens, and seeded n > 1 samples each follow the grammar."""

from __future__ import annotations

import json
import time

import jsonschema
import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.grammar import Grammars
from splitserve.sampling.grammar_check import GrammarError
from splitserve.sampling.params import GrammarSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "k": {"enum": ["x", "y"]},
        "s": {"type": "string", "maxLength": 5},
    },
    "required": ["n", "k", "s"],
}
SPEC = GrammarSpec("json", json.dumps(SCHEMA))


@pytest.fixture(scope="module")
def llm() -> LLM:
    return LLM(model="random:tiny-chat", max_model_len=512, kv_cache_bytes=16 << 20, progress=False)


def test_a_slow_compile_never_stalls_other_requests(llm, monkeypatch):
    engine = llm.engine
    compile_now = Grammars._compile

    def slow(self, spec):
        time.sleep(1.5)
        return compile_now(self, spec)

    monkeypatch.setattr(Grammars, "_compile", slow)
    slow_spec = GrammarSpec("regex", "[a-c]{3}")
    engine.add_request([5, 6, 7], SamplingParams(max_tokens=10, grammar=slow_spec), "constrained")
    engine.add_request([5, 6, 8], SamplingParams(max_tokens=10, temperature=0), "plain")
    start, done = time.monotonic(), {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = (time.monotonic() - start, out.outputs[0])
    assert done["plain"][0] < 1.0 < done["constrained"][0]  # plain ran while the grammar compiled
    assert len(done["constrained"][1].text) == 3 and set(done["constrained"][1].text) <= set("abc")
    assert engine.pool.num_free == engine.pool.num_blocks


def test_abort_while_compiling_frees_everything(llm, monkeypatch):
    engine = llm.engine
    compile_now = Grammars._compile
    monkeypatch.setattr(
        Grammars, "_compile", lambda self, spec: (time.sleep(0.5), compile_now(self, spec))[1]
    )
    engine.add_request([9, 9, 9], SamplingParams(max_tokens=10, grammar=GrammarSpec("regex", "z+")), "gone")
    engine.step()
    engine.abort("gone")
    time.sleep(0.6)
    assert engine.step() == [] and not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks


def test_a_bad_grammar_is_refused_at_add(llm):
    llm.engine.grammars.compile(GrammarSpec("regex", "(ab")).exception()
    with pytest.raises(GrammarError, match="regex"):
        llm.engine.add_request([1, 2], SamplingParams(grammar=GrammarSpec("regex", "(ab")))
    assert not llm.engine.has_unfinished_requests()


def test_seeded_samples_and_an_adopted_first_token_follow_the_grammar(llm):
    """n = 3 seeded samples each validate; a request adopted with a first token sampled elsewhere (the
    decode side's path) has it replayed into its matcher and goes on under the grammar. (Token-exact
    equality through the split, generator state included: tests/router/test_structured.py.)"""
    (out,) = llm.generate(
        [{"prompt_token_ids": [11, 12, 13]}], SamplingParams(n=3, seed=5, max_tokens=60, grammar=SPEC)
    )
    texts = [c.text for c in out.outputs]
    for text in texts:
        jsonschema.validate(json.loads(text), SCHEMA)
    engine = llm.engine
    first = out.outputs[0].token_ids[0]
    params = SamplingParams(seed=5, max_tokens=60, grammar=SPEC)
    port = engine.transfers.port  # what a KV import does to the engine (kv_transfer_port.py)
    req = port.build_request([11, 12, 13], params, "replayed")
    assert port.adopt(req, first, None, 0) is None  # recompute the prompt here, first token given
    while engine.has_unfinished_requests():
        engine.step()
    assert req.output_token_ids[0] == first
    jsonschema.validate(json.loads(req.text), SCHEMA)


def test_constrained_requests_take_part_in_overlapped_steps():
    """Overlapped steps with grammars (overlap.py: step N's tokens read and the matchers advanced while
    N+1's forward runs, N+1's mask filled then): the same tokens as without overlap, greedy and seeded,
    grammars that end early (their extra token dropped) or are cut by length, beside an unconstrained
    row; the pool whole afterwards."""
    kw = {"model": "random:tiny-chat", "max_model_len": 512, "kv_cache_bytes": 16 << 20, "progress": False}
    plain, overlapped = LLM(**kw, async_scheduling=False), LLM(**kw, async_scheduling=True)
    params = [
        SamplingParams(temperature=0, max_tokens=60, grammar=SPEC),
        SamplingParams(temperature=0, max_tokens=30, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=3, max_tokens=40, grammar=GrammarSpec("regex", "[a-e]{2,9}")),
        SamplingParams(temperature=0, max_tokens=12, grammar=GrammarSpec("choice", '["yes", "no", "maybe"]')),
        SamplingParams(temperature=0, max_tokens=8, grammar=SPEC),  # cut by length amid the JSON
    ]
    prompts = [{"prompt_token_ids": [11 + i, 12, 13 + 2 * i]} for i in range(len(params))]

    def run(llm: LLM) -> list[tuple[list[int], str, str]]:
        outs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.engine
        assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_unfinished_requests()
        return [(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs]

    got = run(overlapped)
    assert got == run(plain)
    assert overlapped.engine.overlapped_steps > 10 and plain.engine.overlapped_steps == 0
    jsonschema.validate(json.loads(got[0][1]), SCHEMA)
    assert [g[2] for g in got] == ["stop", "length", "stop", "stop", "length"]
    assert got[3][1] in ("yes", "no", "maybe") and set(got[2][1]) <= set("abcde")


def test_a_compile_past_its_deadline_fails_the_request_alone(llm, monkeypatch):
    """A grammar still compiling at the deadline ends its request ("abort" out of the step, the failure
    a `GrammarTimeout` for a serving core to answer with a 503) and holds nothing; a plain request
    beside it is untouched; the compile goes on and is cached, so the same spec then costs nothing."""
    from splitserve.engine.grammar import GrammarTimeout

    engine = llm.engine
    compile_now = Grammars._compile
    monkeypatch.setattr(
        Grammars, "_compile", lambda self, spec: (time.sleep(1.0), compile_now(self, spec))[1]
    )
    monkeypatch.setattr(engine._compiling, "timeout_s", 0.2)
    spec = GrammarSpec("regex", "[d-f]{4}")
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=10, grammar=spec), "late")
    engine.add_request([3, 4, 6], SamplingParams(max_tokens=10, temperature=0), "beside")
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0] for o in engine.step() if o.finished}
    assert done["late"].finish_reason == "abort" and done["beside"].finish_reason == "length"
    ((rid, why),) = engine.take_grammar_failures()
    assert rid == "late" and isinstance(why, GrammarTimeout)
    assert engine.pool.num_free == engine.pool.num_blocks
    engine.grammars.compile(spec).result()  # compiled meanwhile: the same spec now admits at once
    engine.add_request([3, 4, 5], SamplingParams(max_tokens=4, grammar=spec), "again")
    assert not engine._compiling
    while engine.has_unfinished_requests():
        engine.step()


def test_an_abort_cancels_a_compile_nobody_else_waits_for(llm, monkeypatch):
    """With every grammar thread busy, a request whose compile has not started is aborted: the compile
    is cancelled and its cache entry dropped; a compile another request still waits for is kept."""
    engine = llm.engine
    compile_now = Grammars._compile
    monkeypatch.setattr(
        Grammars, "_compile", lambda self, spec: (time.sleep(0.5), compile_now(self, spec))[1]
    )
    busy = [GrammarSpec("regex", f"[g-i]{{{n}}}") for n in (5, 6)]  # both threads of the pool
    for i, spec in enumerate(busy):
        engine.add_request([7, 8, i], SamplingParams(max_tokens=3, grammar=spec), f"busy{i}")
    queued, shared = GrammarSpec("regex", "[j-k]{7}"), GrammarSpec("regex", "[j-k]{8}")
    engine.add_request([7, 8, 9], SamplingParams(max_tokens=3, grammar=queued), "queued")
    engine.add_request([7, 8, 10], SamplingParams(max_tokens=3, grammar=shared), "shared1")
    engine.add_request([7, 8, 11], SamplingParams(max_tokens=3, grammar=shared), "shared2")
    fut = engine.grammars.compile(queued)
    engine.abort("queued")
    engine.abort("shared1")
    assert fut.cancelled() and engine.grammars.compile(queued) is not fut
    engine.grammars.cancel(queued)
    while engine.has_unfinished_requests():
        engine.step()
    assert engine.grammars.compile(shared).result() is not None  # shared2 kept it
    assert engine.pool.num_free == engine.pool.num_blocks
