"""Tensor parallelism's parts on one CUDA device: each sharded layer (attention by heads with KV heads
replicated below the rank count, MLP column/row, Gated DeltaNet by head with its conv channels and
recurrent state, vocabulary-parallel embedding and LM head) for every rank of size 2 (and 4 where the
shapes split), combined as the collectives would, against the unsharded layer in fp32; and the KV and
state re-layout a decode rank receives its heads by (the exporter's selection on the device, the
receiver's placement into its device blocks). The checks are tests/tp_shard_checks.py's, which
tests/model/test_tp_shards_cpu.py runs on the CPU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
import tp_shard_checks as checks

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(autouse=True)
def ieee_fp32():
    """fp32 convolutions and matmuls as IEEE fp32 (not TF32) for the comparisons."""
    saved = torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32
    torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
    yield
    torch.backends.cudnn.allow_tf32, torch.backends.cuda.matmul.allow_tf32 = saved


@pytest.mark.parametrize(("shape", "size"), checks.ALL)
def test_attention_shards_sum_to_the_unsharded_layer_cuda(shape, size):
    checks.check_attention(shape, size, "cuda")


@pytest.mark.parametrize(("shape", "size"), checks.ALL)
def test_mlp_shards_match_the_unsharded_layer_cuda(shape, size):
    checks.check_mlp(shape, size, "cuda")


@pytest.mark.parametrize("fused", [False, True])
def test_gated_deltanet_shards_match_the_unsharded_layer_cuda(fused):
    checks.check_gated_deltanet("random:qwen3.5-tiny", 2, "cuda", fused=fused)


@pytest.mark.parametrize(("shape", "size"), checks.ALL)
def test_vocab_parallel_embedding_and_lm_head_cuda(shape, size):
    checks.check_vocab_parallel(shape, size, "cuda")


@pytest.mark.parametrize(("prefill", "decode"), checks.SIZES)
@pytest.mark.parametrize("shape", ["random:tiny", "random:tiny-llama"])
def test_kv_relayout_dense_cuda(shape, prefill, decode):
    checks.check_relayout(shape, prefill, decode, "cuda")


@pytest.mark.parametrize(("prefill", "decode"), checks.HYBRID_SIZES)
def test_kv_and_state_relayout_hybrid_cuda(prefill, decode):
    checks.check_relayout("random:qwen3.5-tiny", prefill, decode, "cuda")
