"""Greedy output is token-exact against HF transformers on the same weights (fp32, CPU), under every
scheduling path: one batch, staggered arrivals, chunked prefill, prefix-cache hits, forced preemption."""

from __future__ import annotations

import pytest

from splitserve import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=64)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


def _assert_pool_full(llm) -> None:
    pool = llm.engine.pool
    assert pool.num_free == pool.num_blocks
    assert not llm.engine.has_unfinished_requests()


def test_smollm_greedy_matches_hf(smol_llm, chat_prompt_ids, hf_smol_greedy):
    outs = smol_llm.generate([{"prompt_token_ids": p} for p in chat_prompt_ids], GREEDY, use_tqdm=False)
    assert _tokens(outs) == hf_smol_greedy
    assert sum(len(t) for t in hf_smol_greedy) > 150  # the comparison has substance
    _assert_pool_full(smol_llm)


def test_staggered_arrivals_match_hf(smol_llm, chat_prompt_ids, hf_smol_greedy):
    engine = smol_llm.engine
    done: dict[str, list[int]] = {}
    ids: list[str] = []
    pending = list(enumerate(chat_prompt_ids))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 3 == 0:  # a new request every third step, joining a running batch
            i, prompt = pending.pop(0)
            ids.append(engine.add_request(prompt, GREEDY, request_id=f"stagger-{i}"))
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
        step += 1
    assert [done[i] for i in ids] == hf_smol_greedy
    _assert_pool_full(smol_llm)


def test_chunked_prefill_matches_hf(make_smol_llm, chat_prompt_ids, hf_smol_greedy):
    llm = make_smol_llm(max_num_batched_tokens=16)  # every prompt (>16 tokens) is split
    assert min(len(p) for p in chat_prompt_ids) > 16
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompt_ids], GREEDY, use_tqdm=False)
    assert _tokens(outs) == hf_smol_greedy
    _assert_pool_full(llm)


def test_prefix_cache_hits_match_hf(make_smol_llm, chat_prompt_ids, hf_smol_greedy):
    llm = make_smol_llm()
    first = llm.generate([{"prompt_token_ids": p} for p in chat_prompt_ids], GREEDY, use_tqdm=False)
    again = llm.generate([{"prompt_token_ids": p} for p in chat_prompt_ids], GREEDY, use_tqdm=False)
    assert _tokens(first) == _tokens(again) == hf_smol_greedy
    assert all(o.num_cached_tokens > 0 for o in again)
    assert llm.engine.pool.hits > 0
    _assert_pool_full(llm)


@pytest.mark.parametrize("num_blocks", [12, 24])
def test_forced_preemption_matches_hf(
    make_smol_llm, smol_loaded, chat_prompt_ids, hf_smol_greedy, num_blocks
):
    import torch

    from splitserve.engine.config import block_bytes

    per_block = block_bytes(smol_loaded.config, 16, torch.float32)
    llm = make_smol_llm(kv_cache_bytes=num_blocks * per_block, enable_prefix_caching=num_blocks == 24)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompt_ids], GREEDY, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions > 0
    assert _tokens(outs) == hf_smol_greedy
    _assert_pool_full(llm)


def test_text_and_finish_reason(smol_llm, smol_tokenizer):
    out = smol_llm.chat(
        [{"role": "user", "content": "What is the capital of France?"}], GREEDY, use_tqdm=False
    )
    o = out[0].outputs[0]
    assert "Paris" in o.text
    assert o.finish_reason == "stop" and o.token_ids[-1] in smol_tokenizer.eos_token_ids
    assert o.text == smol_tokenizer.decode(o.token_ids)
