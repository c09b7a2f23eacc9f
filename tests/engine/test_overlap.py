"""Overlapped decode steps (`async_scheduling`): the engine launches step N+1 with step N's tokens
still on the device and reads them afterwards. On CPU nothing runs concurrently, but every piece of
the bookkeeping runs the same way (placeholder tokens, tokens fed on the device, late stop checks,
dropped tokens of requests that stopped, blocks freed): the outputs must equal the plain engine's,
token for token, with the KV pool whole again afterwards."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine.overlap import PLACEHOLDER


def _llm(tiny, overlap: bool, **knobs) -> LLM:
    knobs.setdefault("kv_cache_bytes", 4 * 2**20)
    return LLM(model=str(tiny.path), max_model_len=256, progress=False, async_scheduling=overlap, **knobs)


def _generate(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    pool = llm.engine.pool
    assert pool.num_free == pool.num_blocks and not llm.engine.has_unfinished_requests()
    for o in outs:
        assert PLACEHOLDER not in o.outputs[0].token_ids
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen3")


@pytest.fixture(scope="module")
def engines(tiny):
    return _llm(tiny, False), _llm(tiny, True)


def test_greedy_equals_hf_and_the_plain_engine(engines, tiny):
    plain, overlapped = engines
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (24, 3, 11, 24, 1, 7)]
    got = _generate(overlapped, tiny.prompts, params)
    assert got == _generate(plain, tiny.prompts, params)
    assert got == [hf[: p.max_tokens] for hf, p in zip(tiny.hf_greedy, params, strict=True)]
    assert overlapped.engine.overlapped_steps > 0 and plain.engine.overlapped_steps == 0


def test_stops_mid_output_drop_the_extra_token(engines, tiny):
    """Each request stops on a token of its own greedy output (stop_token_ids): found one step late,
    after the next step was launched; that step's token is dropped."""
    plain, overlapped = engines
    params = [SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[hf[k]])
              for hf, k in zip(tiny.hf_greedy, (5, 1, 12, 20, 2, 9), strict=True)]  # fmt: skip
    got = _generate(overlapped, tiny.prompts, params)
    assert got == _generate(plain, tiny.prompts, params)
    assert any(len(g) < 24 for g in got)


def test_seeded_sampling_and_non_overlappable_requests_in_the_batch(engines, tiny):
    plain, overlapped = engines
    params = [
        SamplingParams(temperature=0.9, top_k=50, top_p=0.9, seed=11, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=16, logprobs=2),  # needs the host each step
        SamplingParams(temperature=1.2, min_p=0.05, seed=3, max_tokens=16),
        SamplingParams(temperature=0, max_tokens=16, repetition_penalty=1.3),
    ]
    prompts = tiny.prompts[:4]
    assert _generate(overlapped, prompts, params) == _generate(plain, prompts, params)
    only = [params[0], params[2]]  # all overlappable: the steady state overlaps
    before = overlapped.engine.overlapped_steps
    assert _generate(overlapped, prompts[:2], only) == _generate(plain, prompts[:2], only)
    assert overlapped.engine.overlapped_steps > before


def _drive(llm: LLM, plan: dict[int, list[tuple[str, list[int], int]]], abort_at: dict[int, str]) -> dict:
    """Step the engine by hand: add requests and abort them at given steps; -> final token ids."""
    engine, done, step = llm.engine, {}, 0
    while step in plan or engine.has_unfinished_requests() or any(s >= step for s in plan):
        for rid, prompt, n in plan.get(step, []):
            engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True), rid)
        if step in abort_at:
            engine.abort(abort_at[step])
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    pool = engine.pool
    assert pool.num_free == pool.num_blocks
    return done


def test_arrivals_and_aborts_while_a_step_is_pending(engines, tiny):
    plain, overlapped = engines
    p = tiny.prompts
    plan = {0: [("a", p[0], 20), ("b", p[1], 20)], 6: [("c", p[2], 8)], 9: [("d", p[5], 5)]}
    aborts = {4: "b", 12: "a"}
    got = _drive(overlapped, plan, aborts)
    assert got == _drive(plain, plan, aborts)
    assert set(got) == {"c", "d"} and got["c"] == tiny.hf_greedy[2][:8] and got["d"] == tiny.hf_greedy[5][:5]


def test_a_full_batch_with_a_queue_keeps_overlapping(tiny):
    """max_num_seqs 2, six requests: four wait while two decode; those steps still overlap."""
    plain, overlapped = _llm(tiny, False, max_num_seqs=2), _llm(tiny, True, max_num_seqs=2)
    params = [SamplingParams(temperature=0, max_tokens=m, ignore_eos=True) for m in (12, 20, 5, 16, 9, 14)]
    got = _generate(overlapped, tiny.prompts, params)
    assert got == _generate(plain, tiny.prompts, params)
    assert got == [hf[: p.max_tokens] for hf, p in zip(tiny.hf_greedy, params, strict=True)]
    decode_steps = sum(p.max_tokens for p in params) // 2
    assert overlapped.engine.overlapped_steps > decode_steps // 2


def test_a_failed_step_unwinds_the_pending_one(tiny, monkeypatch):
    """A step that raises while the previous one is pending (a CUDA OOM, say): the pending step's
    tokens are forgotten, and stepping on recomputes them; the outputs are still the plain ones."""
    llm = _llm(tiny, True)
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    engine.add_request(tiny.prompts[0], params, "a")
    engine.add_request(tiny.prompts[1], params, "b")
    while engine.overlap.pending is None:
        engine.step()
    execute = engine.runner.execute

    def fail_once(chunks, feed=None):  # noqa: ANN001, ANN202
        engine.runner.execute = execute
        raise RuntimeError("CUDA out of memory (injected)")

    engine.runner.execute = fail_once
    with pytest.raises(RuntimeError, match="injected"):
        engine.step()
    for req in engine.requests.values():
        assert PLACEHOLDER not in req.output_token_ids
        assert req.num_computed_tokens == req.num_tokens - 1
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    assert done == {"a": tiny.hf_greedy[0][:12], "b": tiny.hf_greedy[1][:12]}
    assert engine.pool.num_free == engine.pool.num_blocks
