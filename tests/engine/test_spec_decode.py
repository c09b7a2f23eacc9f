"""Speculative decoding (engine/spec/) on dense models: greedy output with drafts verified equals
output without them, token for token (and HF's), under continuous batching, chunked prefill and
preemption; drafts rejected at every position leave the KV as a run without drafts has it, return
their blocks and never reach the prefix cache; the n-gram drafter; the config and its errors."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from spec_helpers import OracleDrafter, trace

from splitserve import LLM, SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.config.speculative import SpeculativeConfig, speculative_config
from splitserve.engine.config import block_bytes
from splitserve.engine.spec.ngram import NgramDrafter
from splitserve.model.config import ModelConfig

ARCHS = ["qwen3", "llama3"]
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _llm(tiny, **knobs) -> LLM:
    knobs.setdefault("kv_cache_bytes", 4 * 2**20)
    return LLM(model=str(tiny.path), max_model_len=256, progress=False, **knobs)


def _greedy(tiny, llm: LLM, prompts=None) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts or tiny.prompts], params, use_tqdm=False)
    engine = llm.engine
    assert engine.pool.num_free == engine.pool.num_blocks and not engine.has_unfinished_requests()
    return [o.outputs[0].token_ids for o in outs]


def _oracle(tiny, llm: LLM, wrong_every: int) -> None:
    vocab = llm.engine.model_config.vocab_size
    llm.engine.spec.drafter = OracleDrafter(tiny.prompts, tiny.hf_greedy, vocab, wrong_every)


@pytest.mark.parametrize("arch", ARCHS)
def test_ngram_greedy_equals_plain(tiny_model_factory, arch):
    tiny = tiny_model_factory(arch)
    llm = _llm(tiny, speculative_config=NGRAM)
    prompts = [p + p[: len(p) // 2] for p in tiny.prompts]  # repeats: the drafter finds matches
    plain = _greedy(tiny, _llm(tiny), prompts)
    assert _greedy(tiny, llm, prompts) == plain
    spec = llm.engine.stats().spec_decode
    assert spec is not None and spec.num_drafts > 0 and spec.num_draft_tokens >= spec.num_drafts


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("knobs", [{}, {"max_num_batched_tokens": 16}, {"preempt": True}])
def test_verified_drafts_equal_hf(tiny_model_factory, arch, knobs):
    """Drafts right except every third output position: runs accept 0..k drafts, mixed in one batch
    with prefill chunks (a 16-token budget also cuts drafts short), and under forced preemption."""
    tiny = tiny_model_factory(arch)
    knobs = dict(knobs)
    fewer_steps = not knobs
    if knobs.pop("preempt", False):
        cfg = ModelConfig.from_hf(__import__("json").loads((tiny.path / "config.json").read_text()))
        knobs["kv_cache_bytes"] = 10 * block_bytes(cfg, 16, torch.float32)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    llm = _llm(tiny, speculative_config=spec, **knobs)
    _oracle(tiny, llm, wrong_every=3)
    assert _greedy(tiny, llm) == tiny.hf_greedy
    stats = llm.engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
    assert stats.accepted_per_pos[0] >= stats.accepted_per_pos[1] > 0  # runs of 2 (then a wrong one)
    if "kv_cache_bytes" in knobs:
        assert llm.engine.scheduler.num_preemptions > 0
    if fewer_steps:  # 2 of every 3 tokens came from drafts
        plain = _llm(tiny)
        _greedy(tiny, plain)
        assert llm.engine.forward_steps < plain.engine.forward_steps


@pytest.mark.parametrize("arch", ARCHS)
def test_every_draft_rejected_leaves_kv_as_plain(tiny_model_factory, arch):
    tiny = tiny_model_factory(arch)
    prompt = tiny.prompts[2]  # 33 tokens: the output crosses block boundaries
    params = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    plain_tokens, plain = trace(_llm(tiny).engine, prompt, params)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    llm = _llm(tiny, speculative_config=spec)
    _oracle(tiny, llm, wrong_every=1)
    llm.engine.spec.drafter.pairs = [(prompt, tiny.hf_greedy[2])]
    spec_tokens, ours = trace(llm.engine, prompt, params)
    assert spec_tokens == plain_tokens == tiny.hf_greedy[2]
    stats = llm.engine.stats().spec_decode
    assert stats.num_drafts > 0 and stats.num_accepted_tokens == 0  # every draft rejected
    by_computed = {s.computed: s for s in plain}
    for s in ours:  # the KV of every computed position as a run without drafts has it
        torch.testing.assert_close(s.kv, by_computed[s.computed].kv, rtol=1e-5, atol=1e-5)
        assert s.blocks <= -(-s.num_tokens // 16)  # the blocks that drafts used are back
    pool = llm.engine.pool
    assert pool.num_free == pool.num_blocks
    # the prefix cache holds the blocks of the real tokens only, not of any draft
    from splitserve.engine.block_pool import ROOT_HASH, hash_block

    seq, parent, real = prompt + spec_tokens, ROOT_HASH, set()
    for i in range(len(seq) // 16):
        parent = hash_block(parent, seq[i * 16 : (i + 1) * 16])
        real.add(parent)
    cached = {h for h in pool.block_hash if h is not None}
    assert cached and cached <= real


def test_stop_and_max_tokens_inside_an_accepted_run(tiny_model_factory):
    tiny = tiny_model_factory("qwen3")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    ref = tiny.hf_greedy[1]
    stop_id = ref[6]
    first = ref.index(stop_id)
    for params, want in [
        (SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), ref[:5]),
        (SamplingParams(temperature=0, max_tokens=20, stop_token_ids=[stop_id]), ref[: first + 1]),
    ]:
        llm = _llm(tiny, speculative_config=spec)
        _oracle(tiny, llm, wrong_every=100)  # every draft right: runs of 5 tokens
        out = llm.generate([{"prompt_token_ids": tiny.prompts[1]}], params, use_tqdm=False)[0]
        assert out.outputs[0].token_ids == want
        assert llm.engine.pool.num_free == llm.engine.pool.num_blocks


def test_ngram_drafter():
    d = NgramDrafter(1, 3)
    t = np.array([5, 6, 7, 8, 9, 1, 5, 6, 7, 2, 5, 6, 7])
    assert d.propose(t, 3) == [2, 5, 6]  # the latest earlier [5, 6, 7] is followed by 2
    assert d.propose(np.array([1, 2, 3, 4]), 3) == []  # nothing repeats
    assert d.propose(np.array([4, 1, 2, 9, 9, 3, 1, 2]), 2) == [9, 9]
    assert NgramDrafter(3, 3).propose(np.array([1, 2, 3, 9, 2, 3]), 2) == []  # [2, 3] is too short
    assert d.propose(t, 0) == []


def test_speculative_config_parsing():
    cfg = speculative_config('{"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_max": 4}')
    assert cfg == SpeculativeConfig(num_speculative_tokens=2, prompt_lookup_min=4, prompt_lookup_max=4)
    assert SpeculativeConfig().ngram_range == (2, 5)
    assert speculative_config(None) is None
    for bad, words in [
        ({"method": "eagle"}, "method"),
        ({"num_speculative_tokens": 0}, "positive"),
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, "exceed"),
        ({"num_speculative_token": 2}, "unknown"),
        ("{not json", "JSON"),
    ]:
        with pytest.raises(ValueError, match=words):
            speculative_config(bad)
    assert EngineConfig(
        speculative_config={"num_speculative_tokens": 2}
    ).speculative_config  # parsed by the engine


def test_sampled_requests_verify_drafts(tiny_model_factory):
    """Sampled requests (temperature, top_k) go through rejection sampling: a low temperature accepts
    greedy-continuation drafts; a seeded request repeats itself; greedy rows beside them stay exact."""
    tiny = tiny_model_factory("qwen3")
    spec = {"method": "ngram", "num_speculative_tokens": 4, "disable_by_batch_size": None}
    runs = []
    for _ in range(2):
        llm = _llm(tiny, speculative_config=spec)
        _oracle(tiny, llm, wrong_every=100)
        sampled = SamplingParams(temperature=0.3, top_k=50, seed=7, max_tokens=tiny.max_new, ignore_eos=True)
        greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in tiny.prompts[:4]]
        outs = llm.generate(prompts, [sampled, greedy, sampled, greedy], use_tqdm=False)
        runs.append([o.outputs[0].token_ids for o in outs])
        stats = llm.engine.stats().spec_decode
        assert stats.num_accepted_tokens > stats.num_draft_tokens // 4  # the greedy rows accept all
    assert runs[0] == runs[1]
    assert runs[0][1] == tiny.hf_greedy[1] and runs[0][3] == tiny.hf_greedy[3]
    assert all(len(t) == tiny.max_new for t in runs[0])
