"""The MTP head's graphs (engine/spec/mtp_graphs.py), checked on the CPU without capture: every graph is a
stand-in that runs its forward over the static buffers (as a replay does), the target's decode and
verify graphs included, so the rows the head's catch-up reads from those graphs' buffers, the tokens
it takes, the drafting rows of each further draft and their padding are those of the CUDA path. Whole
greedy generations of the tiny random Qwen3.5 with its random MTP head: the tokens equal those without
speculation, and the drafts of every step equal the eager head's (the target's stand-in graphs on in
both), at batch 1 and 3, k = 1 and 3; random weights reject nearly every draft, and with the
acceptance forced to a seeded coin (as bench/spec_verify_gpu.py forces it) some are accepted."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from graph_stand_ins import stand_ins
from spec_forcing import forced_accept

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.spec import verify

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

PARAMS = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)


def _generate(k: int | None, batch: int, head: bool = True) -> tuple[list[list[int]], list[dict], Counter]:
    """Greedy tokens of `batch` prompts (k None: no speculation), the drafts made after each step
    (request id -> drafts) and the stand-in graphs' replays by kind."""
    spec = (
        None if k is None else {"method": "mtp", "num_speculative_tokens": k, "disable_by_batch_size": None}
    )
    config = EngineConfig(model="random:qwen3.5-tiny", device="cpu", dtype="float32", max_model_len=128,
                          max_num_seqs=4, kv_cache_bytes=4 * 2**20, enable_prefix_caching=False,
                          speculative_config=spec, progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=None)
    counts = stand_ins(engine, k, head) if k is not None else Counter()
    made: list[dict] = []
    mtp = engine.spec.mtp if engine.spec is not None else None
    if mtp is not None:
        make = mtp._make

        def recording(runner, blocks, budget, reqs, lasts) -> None:  # noqa: ANN001
            make(runner, blocks, budget, reqs, lasts)
            made.append({r.request_id: mtp.drafts[id(r)][1] for r in reqs if id(r) in mtp.drafts})

        mtp._make = recording  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(batch)
    ids = [engine.add_request(torch.randint(3, 200, (n,), generator=gen).tolist(), PARAMS)
           for n in (23, 6, 40)[:batch]]  # fmt: skip
    tokens: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[i] for i in ids], made, counts


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_head_graph_layout_drafts_as_the_eager_head(k: int, batch: int):
    plain, _, _ = _generate(None, batch)
    tokens, drafts, counts = _generate(k, batch)
    eager_tokens, eager_drafts, eager_counts = _generate(k, batch, head=False)
    assert tokens == plain and eager_tokens == plain
    assert drafts == eager_drafts and any(drafts)
    assert counts["catch-up decode"] > 0 and counts["catch-up verify"] > 0 and counts["drafts"] > 0
    assert counts["verify"] == eager_counts["verify"] > 0 and "drafts" not in eager_counts


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("batch", [1, 3])
def test_head_graph_layout_with_drafts_accepted(k: int, batch: int, monkeypatch):
    runs = []
    for head in (True, False):
        monkeypatch.setattr(verify, "accept_greedy", forced_accept(0.6))  # the same coins for each run
        runs.append(_generate(k, batch, head))
    (tokens, drafts, counts), (eager_tokens, eager_drafts, _) = runs
    assert drafts == eager_drafts and any(drafts)
    assert tokens == eager_tokens
    assert counts["catch-up verify"] > 0 and counts["drafts"] > 0
