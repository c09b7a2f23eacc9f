"""A step that raises despite admission checks is pinned on the request that causes it.
The engine steps each request of the failed batch alone (isolate.py): the poison request is aborted
with its error, every other request finishes with exactly its greedy output (HF's), and the KV pool
is whole afterwards, instead of every request in the step failing. Plain and overlapped steps."""

from __future__ import annotations

import pytest

from splitserve import LLM, SamplingParams
from splitserve.engine import isolate

POISON = 999  # the test hook makes any step that computes this token raise


@pytest.fixture(scope="module")
def tiny(tiny_model_factory):
    return tiny_model_factory("qwen3")


def _run(llm: LLM, tiny, poison_after_steps: int) -> tuple[dict[str, list[int]], dict[str, BaseException]]:
    engine = llm.engine
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, p in enumerate(tiny.prompts):
        engine.add_request(p, params, f"innocent-{i}")
    tokens: dict[str, list[int]] = {}
    culprits: dict[str, BaseException] = {}
    steps = 0
    while engine.has_unfinished_requests():
        if steps == poison_after_steps:
            engine.add_request([5, 6, POISON, 7] * 4, params, "poison")
        try:
            outputs = engine.step()
        except isolate.InjectedStepFault:
            ids = [f"innocent-{i}" for i in range(len(tiny.prompts))] + ["poison"]
            outputs, pinned = isolate.rerun_alone(engine, ids)
            culprits.update(pinned)
        steps += 1
        for out in outputs:
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert engine.pool.num_free == engine.pool.num_blocks
    return tokens, culprits


@pytest.mark.parametrize("overlap", [False, True], ids=["plain", "overlapped"])
@pytest.mark.parametrize("poison_after_steps", [0, 3], ids=["prefilling-beside", "joins-decodes"])
def test_a_step_that_raises_fails_only_its_culprit(tiny, monkeypatch, overlap, poison_after_steps):
    monkeypatch.setattr(isolate, "FAULT_TOKEN", POISON)
    llm = LLM(model=str(tiny.path), max_model_len=256, progress=False, async_scheduling=overlap,
              kv_cache_bytes=4 * 2**20)  # fmt: skip
    tokens, culprits = _run(llm, tiny, poison_after_steps)
    assert list(culprits) == ["poison"]
    assert isinstance(culprits["poison"], isolate.InjectedStepFault)
    for i, hf in enumerate(tiny.hf_greedy):
        assert tokens[f"innocent-{i}"] == hf[:24], i  # token-exact, as if the poison were not there
    if overlap and poison_after_steps:
        assert llm.engine.overlapped_steps > 0


def test_outputs_due_before_a_step_that_raises_are_not_lost(tiny, monkeypatch):
    """An output made outside a step (a grammar that failed to compile, an import that ended) waits for
    the next step; a step that raises hands it to the step after, instead of dropping it."""
    llm = LLM(model=str(tiny.path), max_model_len=256, progress=False, kv_cache_bytes=4 * 2**20)
    engine = llm.engine
    engine.add_request(tiny.prompts[0], SamplingParams(temperature=0, max_tokens=4), "r")
    due = object()
    engine.table.due.post(due)  # type: ignore[arg-type]

    def boom(*_a, **_k):
        raise RuntimeError("injected")

    with monkeypatch.context() as m:
        m.setattr(engine.runner, "execute", boom)
        with pytest.raises(RuntimeError, match="injected"):
            engine.step()
    assert due in engine.step()
