"""Tensor parallelism on CUDA (NCCL between two GPUs of one host): TP=2 greedy tokens in fp32 equal
TP=1's, for a dense and a hybrid tiny random-weight model, with each rank's CUDA graphs (the model's
NCCL collectives captured inside them) and eagerly. Skipped with fewer than two GPUs."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices")

GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
PROMPTS = [[5, 17, 300, 42, 7, 99, 250], list(range(3, 60)), [11] * 20]


def _generate(model: str, tp: int, eager: bool = False) -> list[list[int]]:
    llm = LLM(model=model, device="cuda:0", dtype="float32", max_model_len=256, max_num_seqs=4,
              kv_cache_bytes=16 << 20, tensor_parallel_size=tp, enforce_eager=eager,
              progress=False)  # fmt: skip
    try:
        assert (llm.engine.runner.graphs is None) == eager
        res = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], GREEDY, use_tqdm=False)
        return [r.outputs[0].token_ids for r in res]
    finally:
        if tp > 1:
            llm.engine.runner.close()


@pytest.mark.parametrize("eager", [False, True], ids=["graphs", "eager"])
@pytest.mark.parametrize("model", ["random:tiny", "random:tiny-llama", "random:qwen3.5-tiny"])
def test_tp2_nccl_greedy_equals_tp1(model, eager):
    assert _generate(model, 2, eager) == _generate(model, 1)
