"""The MTP head's CUDA graphs (engine/spec/mtp_graphs.py): with them on, the drafts of every step and the
output tokens equal those with the head run eagerly (the target's graphs on in both), on the tiny random
Qwen3.5 with its random MTP head, in fp32, at batch 1 and a batch of five, for k = 1 and k = 3.

Random weights accept almost no draft: those runs reject every draft of most verify steps (and their
output equals output without speculation). With the acceptance forced to a seeded coin per draft (as
bench/spec_verify_gpu.py forces it), verify steps also accept some drafts, so the catch-up runs over
verified rows past the first and the drafting graphs start from their states.

Skipped without a GPU; on a GPU machine: `python -m pytest tests/gpu/test_mtp_graphs.py -q`.
"""

from __future__ import annotations

import pytest
import torch
from spec_forcing import forced_accept

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.spec import verify

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

MODEL = "random:qwen3.5-tiny"
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _prompts(n: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(n)
    return [torch.randint(3, 500, (length,), generator=g).tolist() for length in (33, 7, 61, 20, 90)[:n]]


def _engine(spec: dict | None, head_graphs: bool = True) -> LLMEngine:
    config = EngineConfig(model=MODEL, device="cuda", dtype="float32", max_model_len=512, max_num_seqs=16,
                          kv_cache_bytes=64 << 20, speculative_config=spec, progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=None)
    if spec is not None:
        assert engine.runner.head_graphs is not None
        if not head_graphs:
            engine.runner.head_graphs = None  # the head's runs eager, the target's graphs as before
    return engine


def _run(engine: LLMEngine, prompts: list[list[int]]) -> tuple[list[list[int]], list[dict[str, list[int]]]]:
    """Greedy tokens of each prompt, and the drafts made after each step (request id -> drafts)."""
    mtp = engine.spec.mtp if engine.spec is not None else None
    made: list[dict[str, list[int]]] = []
    if mtp is not None:
        make = mtp._make

        def recording(runner, blocks, budget, reqs, lasts) -> None:  # noqa: ANN001
            make(runner, blocks, budget, reqs, lasts)
            made.append({r.request_id: mtp.drafts[id(r)][1] for r in reqs if id(r) in mtp.drafts})

        mtp._make = recording  # type: ignore[method-assign]
    ids = [engine.add_request(p, GREEDY) for p in prompts]
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    assert engine.pool.num_free == engine.pool.num_blocks
    return [tokens[i] for i in ids], made


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 5])
def test_head_graphs_make_the_eager_drafts_and_tokens(k: int, batch: int):
    prompts = _prompts(batch)
    plain, _ = _run(_engine(None), prompts)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    graphed = _engine(spec)
    tokens, drafts = _run(graphed, prompts)
    eager_tokens, eager_drafts = _run(_engine(spec, head_graphs=False), prompts)
    assert tokens == plain and eager_tokens == plain
    assert drafts == eager_drafts and any(drafts)
    assert graphed.runner.head_graphs is not None and graphed.runner.head_graphs.replays > 0
    stats = graphed.spec.stats()  # type: ignore[union-attr]
    assert stats.num_drafts > 0 and stats.num_accepted_tokens < stats.num_draft_tokens  # rejections


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 5])
def test_head_graphs_equal_eager_with_drafts_accepted(k: int, batch: int, monkeypatch):
    prompts = _prompts(batch)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    runs = []
    for head_graphs in (True, False):
        engine = _engine(spec, head_graphs)
        monkeypatch.setattr(verify, "accept_greedy", forced_accept(0.6))  # the same coins for each engine
        runs.append((*_run(engine, prompts), engine.spec.stats()))  # type: ignore[union-attr]
    (tokens, drafts, stats), (eager_tokens, eager_drafts, eager_stats) = runs
    assert drafts == eager_drafts and any(drafts)
    assert tokens == eager_tokens
    assert stats == eager_stats
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
