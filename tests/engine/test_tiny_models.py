"""Greedy output is token-exact against HF transformers on tiny random-weight Qwen2 (QKV bias), Qwen3
(QK-norm, explicit head_dim) and Llama (llama3 rope scaling) checkpoints, fp32 on CPU, loaded from
safetensors directories without a tokenizer (token-id prompts), in one batch, with chunked prefill,
and with preemption forced by a tiny KV budget."""

from __future__ import annotations

import json

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import block_bytes
from splitserve.kernels.cpu import fused as cpu_fused
from splitserve.kernels.cpu import prefill as cpu_prefill
from splitserve.model.config import ModelConfig, RopeConfig
from splitserve.model.layers import rope_inv_freq

ARCHS = ["qwen2", "qwen3", "llama3"]


def _make_llm(tiny, **knobs) -> LLM:
    knobs.setdefault("kv_cache_bytes", 4 * 2**20)
    return LLM(model=str(tiny.path), max_model_len=256, progress=False, **knobs)


def _run(llm: LLM, tiny) -> list[list[int]]:
    greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in tiny.prompts], greedy, use_tqdm=False)
    for o in outs:
        assert o.finished and o.outputs[0].finish_reason == "length"
    pool = llm.engine.pool
    assert pool.num_free == pool.num_blocks
    assert not llm.engine.has_unfinished_requests()
    return [o.outputs[0].token_ids for o in outs]


def _model_config(tiny) -> ModelConfig:
    return ModelConfig.from_hf(json.loads((tiny.path / "config.json").read_text()))


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_greedy_matches_hf(tiny_model_factory, arch):
    tiny = tiny_model_factory(arch)
    llm = _make_llm(tiny)
    assert llm.tokenizer is None  # no tokenizer files: prompts are token ids
    cfg = llm.engine.model_config
    assert cfg.num_kv_heads < cfg.num_heads  # GQA
    if arch == "qwen2":
        assert cfg.attention_bias and not cfg.qk_norm
    if arch == "qwen3":
        assert cfg.qk_norm and cfg.head_dim == 32 != cfg.hidden_size // cfg.num_heads
    if arch == "llama3":
        assert cfg.rope.kind == "llama3"
        plain = rope_inv_freq(RopeConfig(theta=cfg.rope.theta), cfg.head_dim)
        assert not torch.allclose(rope_inv_freq(cfg.rope, cfg.head_dim), plain)  # scaling is in effect
    ours = _run(llm, tiny)
    assert ours == tiny.hf_greedy
    assert sum(len(set(t)) for t in ours) > 3 * len(ours)  # not a degenerate repeat of one token


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_chunked_prefill_matches_hf(tiny_model_factory, arch):
    tiny = tiny_model_factory(arch)
    llm = _make_llm(tiny, max_num_batched_tokens=16)
    assert _run(llm, tiny) == tiny.hf_greedy


@pytest.mark.parametrize("arch", ARCHS)
def test_tiny_preemption_matches_hf(tiny_model_factory, arch):
    tiny = tiny_model_factory(arch)
    # 10 blocks of 16 tokens: the longest request (100 + 24 tokens) fits alone, all six need 26.
    per_block = block_bytes(_model_config(tiny), 16, torch.float32)
    llm = _make_llm(tiny, kv_cache_bytes=10 * per_block)
    assert llm.engine.pool.num_blocks == 10
    assert _run(llm, tiny) == tiny.hf_greedy
    assert llm.engine.scheduler.num_preemptions > 0


def test_sequence_longer_than_the_kv_pool_stops_at_its_capacity(tiny_model_factory):
    """A sequence that would outgrow the whole pool must end ("length") when the pool is full; it used
    to preempt itself and wait forever for blocks that could never be free."""
    tiny = tiny_model_factory("qwen2")
    per_block = block_bytes(_model_config(tiny), 16, torch.float32)
    llm = _make_llm(tiny, kv_cache_bytes=8 * per_block)  # 128 tokens
    i = next(i for i, p in enumerate(tiny.prompts) if len(p) == 100)
    prompt = tiny.prompts[i]
    engine = llm.engine
    engine.add_request(prompt, SamplingParams(temperature=0, max_tokens=100, ignore_eos=True), "long")
    final = None
    for _ in range(200):
        for out in engine.step():
            final = out if out.finished else None
        if final is not None:
            break
    assert final is not None, "the request never finished"
    o = final.outputs[0]
    assert o.finish_reason == "length" and len(prompt) + len(o.token_ids) == 128
    assert o.token_ids[: tiny.max_new] == tiny.hf_greedy[i]
    assert engine.pool.num_free == engine.pool.num_blocks


def test_aborts_mid_flight_free_everything_and_leave_the_rest_exact(tiny_model_factory):
    tiny = tiny_model_factory("llama3")
    per_block = block_bytes(_model_config(tiny), 16, torch.float32)
    llm = _make_llm(tiny, kv_cache_bytes=12 * per_block, max_num_batched_tokens=32)
    engine = llm.engine
    greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    keep = {engine.add_request(p, greedy): i for i, p in enumerate(tiny.prompts)}
    sampled = SamplingParams(n=2, temperature=1.0, seed=3, max_tokens=tiny.max_new)
    doomed = [engine.add_request(tiny.prompts[i], sampled) for i in (3, 4)]
    done = {}
    for step in range(500):
        for when, rid in zip((2, 8), doomed, strict=True):
            if step == when:
                assert f"{rid}#0" in engine.requests  # still in flight
                engine.abort(rid)
                assert f"{rid}#0" not in engine.requests and f"{rid}#1" not in engine.requests
        if step == 8:
            engine.abort("no-such-request")  # ignored
        for out in engine.step():
            assert out.request_id != doomed[0] or step < 2
            assert out.request_id != doomed[1] or step < 8
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        if not engine.has_unfinished_requests():
            break
    assert set(done) == set(keep)
    assert [done[rid] for rid in keep] == tiny.hf_greedy
    assert engine.pool.num_free == engine.pool.num_blocks
    assert all(r == 0 for r in engine.pool.ref_counts)
    assert not engine.scheduler.running and not engine.scheduler.waiting


@pytest.mark.parametrize("arch", ARCHS)
def test_fused_and_plain_paths_both_generate_what_hf_does(tiny_model_factory, arch: str, monkeypatch) -> None:
    """Greedy tokens through the fused ops and through the torch path (`cpu_fused` off) equal HF's; the
    fused pass really ran the ops (every forward), the plain pass none of them. The decode layer op
    (kernels/cpu/layer.py, which calls the same ops from C++) is off here: tests/engine/test_cpu_layer.py."""
    if not cpu_fused.load(force=True):
        pytest.skip("the CPU ops could not be built here (no C++ compiler)")
    tiny = tiny_model_factory(arch)
    llm = _make_llm(tiny, enable_prefix_caching=False)  # the second pass computes every token again
    model = llm.engine.runner.model
    assert model.cpu_fused and cpu_fused.ready()
    model.cpu_layer = False
    calls = {"rope_store": 0, "forwards": 0}
    rope_store, forward = cpu_fused.rope_store, type(model).forward

    def counted_rope_store(*args, **kwargs):
        calls["rope_store"] += 1
        return rope_store(*args, **kwargs)

    def counted_forward(self, *args, **kwargs):
        calls["forwards"] += 1
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(cpu_fused, "rope_store", counted_rope_store)
    monkeypatch.setattr(type(model), "forward", counted_forward)
    greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in tiny.prompts]
    fused = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls["forwards"] > 0 and calls["rope_store"] == calls["forwards"] * model.cfg.num_layers
    model.cpu_fused = False
    before = calls["rope_store"]
    plain = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy, use_tqdm=False)]
    assert calls["rope_store"] == before
    assert fused == plain == tiny.hf_greedy


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("budget", [2048, 16])  # 16: prompts chunked, later chunks see earlier ones
def test_prefill_kernel_on_and_off_both_generate_what_hf_does(tiny_model_factory, arch: str, budget: int,
                                                              monkeypatch) -> None:  # fmt: skip
    """Greedy tokens with kernels/cpu/prefill.py's prompt attention and with SDPA equal HF's; the op ran
    once a layer for every prefill chunk in the first pass, never in the second."""
    if not cpu_prefill.load(force=True):
        pytest.skip("the prompt attention op needs AVX-512 and a C++ compiler")
    tiny = tiny_model_factory(arch)
    llm = _make_llm(tiny, enable_prefix_caching=False, max_num_batched_tokens=budget)
    calls = [0]
    op = cpu_prefill.prefill_attention

    def counted(*args, **kwargs):
        calls[0] += 1
        return op(*args, **kwargs)

    monkeypatch.setattr(cpu_prefill, "prefill_attention", counted)
    with_op = _run(llm, tiny)
    chunks = sum(-(-len(p) // budget) for p in tiny.prompts)
    assert calls[0] >= chunks * llm.engine.runner.model.cfg.num_layers
    monkeypatch.setattr(cpu_prefill, "ready", lambda: False)
    before = calls[0]
    assert _run(llm, tiny) == with_op == tiny.hf_greedy
    assert calls[0] == before
