"""Tensor parallelism on the CPU (gloo): an engine at tensor_parallel_size=2 (rank 0 here, rank 1 a child
process it starts) gives the same greedy tokens, in fp32, as one process, for tiny random-weight Llama
(one KV head, shared by both ranks; an odd vocabulary), Qwen3 and the Qwen3.5 hybrid (Gated DeltaNet
heads and their recurrent state sharded; prefix-cache checkpoints replayed on rank 1). Prompts share a
prefix and prefill in chunks, so steps mix decodes and prompt chunks."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.model.config import ModelConfig
from splitserve.model.parallel import check_divisible, kv_heads_of, shard_config, vocab_rows
from splitserve.model.random_weights import random_source_config

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _waves() -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(3, 500, (32,), generator=gen).tolist()
    q = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 21, 40, 2)]
    return [[system + q[0]], [system + q[1], q[3]], [system + q[2], system + q[0], q[1]]]


def _generate(model: str, tp: int) -> list[list[list[int]]]:
    llm = LLM(model=model, device="cpu", dtype="float32", max_model_len=256, max_num_seqs=4,
              kv_cache_bytes=2**20, max_num_batched_tokens=24, tensor_parallel_size=tp,
              progress=False)  # fmt: skip
    try:
        out = []
        for wave in _waves():
            res = llm.generate([{"prompt_token_ids": p} for p in wave], GREEDY, use_tqdm=False)
            out.append([r.outputs[0].token_ids for r in res])
        engine = llm.engine
        assert not engine.has_unfinished_requests() and engine.pool.num_free == engine.pool.num_blocks
        checkpoints = engine.scheduler.block_manager.checkpoints
        if checkpoints is not None:  # the hybrid: prefix hits restored a checkpoint on every rank
            assert checkpoints.saved > 0 and checkpoints.restored > 0
        return out
    finally:
        if tp > 1:
            llm.engine.runner.close()


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny", "random:qwen3.5-tiny"])
def test_tp2_greedy_equals_tp1(model):
    one = _generate(model, 1)
    assert any(len(set(tokens)) > 3 for wave in one for tokens in wave)  # not a degenerate repeat
    assert _generate(model, 2) == one


def test_shard_config_splits_heads_and_replicates_a_lone_kv_head():
    cfg = ModelConfig.from_hf(random_source_config("random:tiny-llama"))
    shard = shard_config(cfg, 2)
    assert (shard.num_heads, shard.num_kv_heads, shard.intermediate_size) == (2, 1, 64)
    assert kv_heads_of(cfg, 2, 0) == kv_heads_of(cfg, 2, 1) == (0, 1)
    assert vocab_rows(cfg.vocab_size, 2, 1) == (255, 254, 255)
    hybrid = shard_config(ModelConfig.from_hf(random_source_config("random:qwen3.5-tiny")), 2)
    assert hybrid.linear is not None
    assert (hybrid.linear.num_key_heads, hybrid.linear.num_value_heads) == (1, 2)
    with pytest.raises(ValueError, match="does not divide .*num_attention_heads"):
        check_divisible(cfg, 3)


def test_tp2_from_a_checkpoint_matches_hf(tiny_model_factory):
    """A safetensors checkpoint (Qwen2: q/k/v biases split by head; 6 query and 2 KV heads: 3 and 1 a
    rank) loaded on each rank and sharded: HF transformers' greedy tokens."""
    tiny = tiny_model_factory("qwen2")
    llm = LLM(model=str(tiny.path), max_model_len=256, kv_cache_bytes=4 * 2**20, tensor_parallel_size=2,
              progress=False)  # fmt: skip
    try:
        greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in tiny.prompts], greedy, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == tiny.hf_greedy
    finally:
        llm.engine.runner.close()
