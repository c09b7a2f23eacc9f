"""Prefix caching for a hybrid model (tiny Qwen3.5, CPU, fp32): requests sharing a system prompt with
different questions after it. The second request with the shared prefix stops its prefill at the
shared block boundary and checkpoints the recurrent state there; later ones restore it and skip the
prefix. Greedy tokens are identical with caching on and off, with chunked prefill and with
preemptions; the hit counters (exported as splitserve:prefix_cache_hits/queries) move."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine.config import block_bytes

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
SYSTEM = 48  # three blocks of 16


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _waves() -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(7)
    system = torch.randint(0, 512, (SYSTEM,), generator=gen).tolist()
    q = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (5, 30, 70, 17, 3)]
    return [
        [system + q[0]],  # a miss
        [system + q[1]],  # a KV hit without state: stops at 48 and checkpoints it
        [system + q[2], system + q[3], system + q[0], system + q[4]],  # state hits at 48
        [system + q[2] + [9, 9]],  # a longer prompt over an earlier one: hit at its last checkpoint
    ]


def _run(caching: bool, **knobs) -> tuple[list[list[list[int]]], LLM]:
    llm = LLM(model="random:qwen3.5-tiny", device="cpu", dtype="float32", max_model_len=256,
              max_num_seqs=4, enable_prefix_caching=caching, progress=False, **knobs)  # fmt: skip
    out = []
    for wave in _waves():
        res = llm.generate([{"prompt_token_ids": p} for p in wave], GREEDY, use_tqdm=False)
        out.append([r.outputs[0].token_ids for r in res])
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.states.num_free == engine.states.num_slots
    return out, llm


@pytest.mark.parametrize(
    "knobs",
    [dict(kv_cache_bytes=2**20), dict(kv_cache_bytes=2**20, max_num_batched_tokens=13), "preempt"],
    ids=["whole", "chunked", "preempted"],
)
def test_greedy_identical_with_and_without_caching(knobs):
    if knobs == "preempt":  # 9 blocks of KV for 4 requests of up to 130 tokens: preemptions
        from splitserve.model.config import ModelConfig
        from splitserve.model.random_weights import random_source_config

        cfg = ModelConfig.from_hf(random_source_config("random:qwen3.5-tiny"))
        knobs = dict(kv_cache_bytes=9 * block_bytes(cfg, 16, torch.float32), max_num_batched_tokens=40)
    ref, _ = _run(False, **knobs)
    got, llm = _run(True, **knobs)
    assert got == ref
    sched, ckpt = llm.engine.scheduler, llm.engine.scheduler.block_manager.checkpoints
    assert ckpt is not None and ckpt.saved >= 1 and ckpt.restored >= 3
    assert sched.prefix_hits >= 3 * SYSTEM and sched.prefix_queries > sched.prefix_hits
    if "max_num_batched_tokens" in knobs and knobs["max_num_batched_tokens"] == 40:
        assert sched.num_preemptions > 0


def test_hybrid_prefix_caching_is_reported_on():
    _, llm = _run(True, kv_cache_bytes=2**20)
    assert llm.engine.pool.enable_prefix_caching
    assert len(llm.engine.scheduler.block_manager.checkpoints) >= 1


def test_checkpoints_evict_least_recently_used():
    from splitserve.engine.state_cache import StateCheckpoints

    states = {"s": torch.arange(4.0).reshape(4, 1)}  # 4 slots of one value each
    ckpt = StateCheckpoints({"s": ((1,), torch.float32)}, 2, torch.device("cpu"))
    ckpt.save(b"a", states, 0)
    ckpt.save(b"b", states, 1)
    ckpt.restore(b"a", states, 3)  # "a" used last: "b" goes first
    ckpt.save(b"c", states, 2)
    assert b"a" in ckpt and b"b" not in ckpt and b"c" in ckpt and len(ckpt) == 2
    assert states["s"][3].item() == 0.0
