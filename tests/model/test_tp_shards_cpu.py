"""Each tensor-parallel layer against the unsharded one, and the KV re-layout between tensor-parallel
sizes, on the CPU (the checks are tests/tp_shard_checks.py's; tests/gpu/test_tp_shards.py runs them
on one CUDA device)."""

from __future__ import annotations

import pytest
import tp_shard_checks as checks


@pytest.mark.parametrize(("shape", "size"), checks.ALL)
def test_attention_shards_sum_to_the_unsharded_layer(shape, size):
    checks.check_attention(shape, size, "cpu")


@pytest.mark.parametrize(("shape", "size"), checks.ALL)
def test_mlp_shards_match_the_unsharded_layer(shape, size):
    checks.check_mlp(shape, size, "cpu")


def test_gated_deltanet_shards_match_the_unsharded_layer():
    checks.check_gated_deltanet("random:qwen3.5-tiny", 2, "cpu")


@pytest.mark.parametrize(("shape", "size"), checks.ALL)
def test_vocab_parallel_embedding_and_lm_head(shape, size):
    checks.check_vocab_parallel(shape, size, "cpu")


@pytest.mark.parametrize(("prefill", "decode"), checks.SIZES)
@pytest.mark.parametrize("shape", ["random:tiny", "random:tiny-llama"])
def test_kv_relayout_dense(shape, prefill, decode):
    checks.check_relayout(shape, prefill, decode, "cpu")


@pytest.mark.parametrize(("prefill", "decode"), checks.HYBRID_SIZES)
def test_kv_and_state_relayout_hybrid(prefill, decode):
    checks.check_relayout("random:qwen3.5-tiny", prefill, decode, "cpu")
