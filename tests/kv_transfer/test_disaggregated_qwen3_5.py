"""Tiny Qwen3.5 (hybrid: KV blocks for the full-attention layers, recurrent state for the DeltaNet
ones), prefill and decode in separate OS processes over tcp, shm and nixl: the state moves with the blocks
and the disaggregated output equals the colocated one, greedy and seeded; state slots come back."""

from __future__ import annotations

import pytest
from kv_transfer_helpers import (
    NIXL,
    assert_pools_full,
    disaggregated,
    in_parallel,
    random_prompts,
    running,
)

pytestmark = pytest.mark.slow

PROMPT_LENS = (3, 17, 40, 90)  # one block, two, three, six (90 > 64: two DeltaNet chunks)
GREEDY = {"temperature": 0, "max_tokens": 20, "ignore_eos": True}
SEEDED = [
    {"temperature": 1.0, "top_k": 50, "seed": 7 + i, "max_tokens": 20, "ignore_eos": True} for i in range(4)
]


@pytest.fixture(scope="module", params=["tcp", "shm", NIXL])
def pair(request, qwen_pairs):
    """The pair test_faults uses too (faults off here; checksums on: they cover the state as well)."""
    return (request.param, *qwen_pairs.get(request.param))


def test_greedy_equals_colocated_with_state(pair):
    backend, p, d = pair
    prompts = random_prompts(PROMPT_LENS)
    colocated = in_parallel(lambda ids: d.generate(ids, GREEDY), prompts)
    transferred = in_parallel(lambda ids: disaggregated(p, d, ids, GREEDY), prompts)
    assert transferred == colocated
    assert all(len(t) == GREEDY["max_tokens"] for t in transferred)
    assert_pools_full(p, d)
    stats = d.stats()
    assert stats["state_slots"]["total"] > 0  # a hybrid model: slots exist and all came back
    kv = stats["kv_transfer"]
    assert kv["backend"] == running(backend) and kv["counts"]["fetches"] >= len(prompts)
    layout = kv["transport"]["layout_fingerprint"]
    assert layout == p.stats()["kv_transfer"]["transport"]["layout_fingerprint"]
    if backend == "nixl":  # the state came by NIXL READs out of the prefill's registered slots, not inline
        nixl = kv["transport"]["nixl"]
        assert nixl["state_slots_registered"] and nixl["state_reads"] >= len(prompts), nixl
        assert nixl.get("state_inline", 0) == 0 and nixl["state_descriptors_last"] == 2, nixl


def test_seeded_sampling_equals_colocated(pair):
    _, p, d = pair
    cases = list(zip(random_prompts(PROMPT_LENS, seed=2), SEEDED, strict=True))
    colocated = in_parallel(lambda c: d.generate(*c), cases)
    transferred = in_parallel(lambda c: disaggregated(p, d, *c), cases)
    assert transferred == colocated
    assert_pools_full(p, d)
