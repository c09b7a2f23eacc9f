"""Sampling on the real default model (SmolLM2-135M-Instruct, fp32 CPU): logprobs against HF
transformers, seeded sampling independent of the batch, n > 1 over a shared prompt, stop conditions,
top_k / penalties, and request validation. Variants are batched into few `generate` calls to keep the
number of model steps small."""

from __future__ import annotations

import pytest
import torch

from splitserve import SamplingParams

FRANCE = "What is the capital of France?"
FRANCE_ANSWER = "The capital of France is Paris."
PARIS_ID = 7042  # " Paris"


@pytest.fixture(scope="module")
def llm(make_smol_llm):
    return make_smol_llm()


@pytest.fixture(scope="module")
def chat_ids(smol_tokenizer):
    def ids(text: str) -> list[int]:
        return smol_tokenizer.apply_chat_template([{"role": "user", "content": text}])

    return ids


def _gen(llm, prompts: list[list[int]], params) -> list:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    _assert_idle(llm)
    return outs


def _assert_idle(llm) -> None:
    pool = llm.engine.pool
    assert not llm.engine.has_unfinished_requests()
    assert pool.num_free == pool.num_blocks
    assert all(r == 0 for r in pool.ref_counts)


# ---- logprobs ---------------------------------------------------------------------------------------


def test_logprobs_match_hf(llm, chat_ids, hf_smol):
    prompt = chat_ids(FRANCE)
    params = [
        SamplingParams(temperature=0, max_tokens=8, logprobs=5),
        SamplingParams(temperature=0, max_tokens=8, logprobs=0),
    ]
    with_top, only_chosen = _gen(llm, [prompt, prompt], params)
    out = with_top.outputs[0]
    assert len(out.token_ids) == len(out.logprobs) == 8
    with torch.inference_mode():
        logits = hf_smol(torch.tensor([prompt + out.token_ids])).logits[0].float()
    hf_lp = torch.log_softmax(logits, dim=-1)
    for i, (tok, lp) in enumerate(zip(out.token_ids, out.logprobs, strict=True)):
        ref = hf_lp[len(prompt) - 1 + i]  # the distribution that produced output token i
        assert lp.token_id == tok and lp.rank == 1  # greedy
        assert lp.logprob == pytest.approx(ref[tok].item(), abs=1e-4)
        assert len(lp.top) == 5 and lp.top[0][0] == tok
        ref_vals, ref_ids = ref.topk(5)
        for (tid, val), ref_id, ref_val in zip(lp.top, ref_ids.tolist(), ref_vals.tolist(), strict=True):
            assert val == pytest.approx(ref_val, abs=1e-4)
            # the same ids, in the same order up to (near-)ties
            assert tid == ref_id or abs(ref[tid].item() - ref_val) < 1e-4
    # logprobs=0: the sampled token's logprob only
    lp0 = only_chosen.outputs[0].logprobs
    assert lp0 and all(x.top == () for x in lp0)
    assert [x.logprob for x in lp0[:8]] == pytest.approx([x.logprob for x in out.logprobs], abs=1e-5)
    # no logprobs asked: None
    assert _gen(llm, [prompt], SamplingParams(temperature=0, max_tokens=1))[0].outputs[0].logprobs is None


# ---- seeds --------------------------------------------------------------------------------------------


def test_seeded_sampling_is_independent_of_the_batch(llm, chat_ids, smol_tokenizer):
    seeded = SamplingParams(temperature=0.8, top_p=0.9, seed=1234, max_tokens=24)
    haiku = chat_ids("Write a haiku about the sea.")
    (alone,) = _gen(llm, [haiku], seeded)
    ref = alone.outputs[0].token_ids
    assert len(ref) >= 8

    others = [
        (chat_ids("List three primary colors."), SamplingParams(temperature=1.0, max_tokens=20)),
        (chat_ids("Explain what a hash table is."), SamplingParams(temperature=0, max_tokens=24)),
        (chat_ids("Give me a tip for learning to code."), SamplingParams(temperature=1.2, top_k=40)),
        (smol_tokenizer.encode("Once upon a time"), SamplingParams(temperature=0.7, min_p=0.05)),
        (chat_ids("What is 12 times 7?"), SamplingParams(temperature=0.9, presence_penalty=0.5)),
    ]
    other_seeds = [1235, 99]
    prompts = [p for p, _ in others[:2]] + [haiku] + [p for p, _ in others[2:]] + [haiku] * len(other_seeds)
    params = (
        [sp for _, sp in others[:2]]
        + [seeded]
        + [sp for _, sp in others[2:]]
        + [SamplingParams(temperature=0.8, top_p=0.9, seed=s, max_tokens=24) for s in other_seeds]
    )
    outs = _gen(llm, prompts, params)
    assert outs[2].outputs[0].token_ids == ref
    assert any(o.outputs[0].token_ids != ref for o in outs[-len(other_seeds) :])


@pytest.mark.parametrize("penalty", [0.0, 0.7])
def test_a_resumed_request_samples_the_tokens_of_one_run_whole(llm, chat_ids, penalty):
    """A migrated request (`resumed`: its prompt's tail is its own earlier output) samples, seeded, the
    same tokens as the run it continues: its generator is past the earlier draws and the frequency
    penalty counts the earlier tokens."""
    kw = {"temperature": 0.9, "seed": 11, "ignore_eos": True, "frequency_penalty": penalty}
    prompt = chat_ids("Tell me about the sea.")
    (whole,) = _gen(llm, [prompt], SamplingParams(max_tokens=24, **kw))
    ids = list(whole.outputs[0].token_ids)
    for k in (1, 9):
        (rest,) = _gen(llm, [prompt + ids[:k]], SamplingParams(max_tokens=24 - k, resumed=k, **kw))
        assert list(rest.outputs[0].token_ids) == ids[k:], k
    (fresh,) = _gen(llm, [prompt + ids[:9]], SamplingParams(max_tokens=15, **kw))
    assert list(fresh.outputs[0].token_ids) != ids[9:]  # without `resumed`: the seed's first draws


def test_n_samples_share_the_prompt_blocks(llm, chat_ids):
    prompt = chat_ids("Write a haiku about the sea.")
    full_blocks = (len(prompt) - 1) // llm.engine.block_size
    assert full_blocks >= 2
    engine = llm.engine
    engine.pool.reset_prefix_cache()
    hits = engine.pool.hits
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=16)
    engine.add_request(prompt, params, request_id="n3")
    engine.add_request(prompt, SamplingParams(temperature=1.0, seed=7, max_tokens=16), request_id="single")
    children = [engine.requests[f"n3#{i}"] for i in range(3)]
    shared = False
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                final[out.request_id] = out
        running = [c for c in children if not c.finished and len(c.block_ids) >= full_blocks]
        if len(running) == 3:
            heads = {tuple(c.block_ids[:full_blocks]) for c in running}
            shared = shared or len(heads) == 1
    assert shared, "the three samples should hold the same prompt blocks"
    assert engine.pool.hits - hits >= 2 * full_blocks
    out = final["n3"]
    assert [o.index for o in out.outputs] == [0, 1, 2]
    assert all(o.finished and o.token_ids for o in out.outputs)
    assert len({tuple(o.token_ids) for o in out.outputs}) > 1  # distinct seeds: distinct samples
    # sample i is seeded with seed + i, so sample 0 is the n=1 request with the same seed
    assert out.outputs[0].token_ids == final["single"].outputs[0].token_ids
    _assert_idle(llm)


# ---- stop conditions ----------------------------------------------------------------------------------


def test_stop_conditions(llm, chat_ids, smol_tokenizer):
    prompt = chat_ids(FRANCE)
    eos = smol_tokenizer.eos_token_ids[0]
    greedy = dict(temperature=0, max_tokens=24)
    cases = {
        "plain": SamplingParams(**greedy),
        "stop": SamplingParams(**greedy, stop=["Paris"]),
        "stop_incl": SamplingParams(**greedy, stop=["Paris"], include_stop_str_in_output=True),
        "two_tokens": SamplingParams(**greedy, stop=["ital of"]),
        "first_of": SamplingParams(**greedy, stop=["xyz", "ital", "cap"]),
        "stop_id": SamplingParams(**greedy, stop_token_ids=[PARIS_ID]),
        "length": SamplingParams(temperature=0, max_tokens=3),
        "ignore_eos": SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
        "min_tokens": SamplingParams(temperature=0, max_tokens=12, min_tokens=10),
        "top_k1": SamplingParams(temperature=1.0, top_k=1, max_tokens=24),
    }
    outs = _gen(llm, [prompt] * len(cases), list(cases.values()))
    o = {name: out.outputs[0] for name, out in zip(cases, outs, strict=True)}

    plain = o["plain"]
    assert plain.text == FRANCE_ANSWER
    assert plain.finish_reason == "stop" and plain.stop_reason is None and plain.token_ids[-1] == eos
    n_answer = len(plain.token_ids) - 1  # the answer's tokens, EOS excluded

    assert o["stop"].text == "The capital of France is "
    assert (o["stop"].finish_reason, o["stop"].stop_reason) == ("stop", "Paris")
    assert o["stop"].token_ids == plain.token_ids[: plain.token_ids.index(PARIS_ID) + 1]

    assert o["stop_incl"].text == "The capital of France is Paris"
    assert o["stop_incl"].stop_reason == "Paris"

    # "ital of" starts inside " capital" and ends in " of"
    assert o["two_tokens"].text == "The cap" and o["two_tokens"].stop_reason == "ital of"
    assert o["two_tokens"].token_ids == plain.token_ids[:3]

    # two stop strings complete with the same token (" capital"): the earlier in the text wins
    assert o["first_of"].text == "The " and o["first_of"].stop_reason == "cap"

    assert o["stop_id"].finish_reason == "stop" and o["stop_id"].stop_reason == PARIS_ID
    assert o["stop_id"].token_ids[-1] == PARIS_ID and o["stop_id"].text.endswith(" Paris")

    assert o["length"].finish_reason == "length" and o["length"].stop_reason is None
    assert o["length"].token_ids == plain.token_ids[:3]

    # ignore_eos: EOS is generated where greedy puts it, and generation runs on to max_tokens
    assert o["ignore_eos"].finish_reason == "length" and len(o["ignore_eos"].token_ids) == 12
    assert o["ignore_eos"].token_ids[: n_answer + 1] == plain.token_ids
    assert o["ignore_eos"].text.startswith(FRANCE_ANSWER)

    # min_tokens: EOS cannot come (nor stop) before 10 tokens; the text begins with the same answer
    mt = o["min_tokens"]
    assert len(mt.token_ids) >= 10 and eos not in mt.token_ids[:10]
    assert mt.token_ids[:n_answer] == plain.token_ids[:n_answer]
    assert mt.finish_reason == ("stop" if mt.token_ids[-1] == eos else "length")

    # top_k=1 sampling is greedy
    assert o["top_k1"].token_ids == plain.token_ids


def test_repetition_penalty_changes_greedy_output_deterministically(llm, smol_tokenizer):
    prompt = smol_tokenizer.encode("apple apple apple apple apple apple apple apple")
    plain = SamplingParams(temperature=0, max_tokens=12)
    penalized = SamplingParams(temperature=0, max_tokens=12, repetition_penalty=1.3)
    a, b, c = (out.outputs[0].token_ids for out in _gen(llm, [prompt] * 3, [plain, penalized, penalized]))
    assert b != a
    assert b == c


# ---- validation ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs",
    [
        {"top_p": 0},
        {"top_p": 1.5},
        {"temperature": -1},
        {"n": 0},
        {"logprobs": 50},
        {"max_tokens": 0},
        {"min_p": 2.0},
        {"repetition_penalty": 0},
        {"stop": [""]},
    ],
)
def test_bad_sampling_params_raise(kwargs):
    with pytest.raises(ValueError):
        SamplingParams(**kwargs)


def test_bad_prompts_raise(llm):
    engine = llm.engine
    vocab = engine.model_config.vocab_size
    too_long = [100] * engine.max_model_len
    with pytest.raises(ValueError, match=r"2048 tokens.*max_model_len is 2048"):
        engine.add_request(too_long)
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate({"prompt_token_ids": too_long}, use_tqdm=False)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request([])
    with pytest.raises(ValueError, match="empty"):
        llm.generate({"prompt_token_ids": []}, use_tqdm=False)
    for bad in ([1, vocab], [-1, 5]):
        with pytest.raises(ValueError, match=f"{vocab}"):
            engine.add_request(bad)
    _assert_idle(llm)
    # the longest prompt that leaves room for one token is accepted, as is
    rid = engine.add_request([100] * (engine.max_model_len - 1), SamplingParams(max_tokens=5))
    assert engine.requests[rid].prompt_token_ids == [100] * (engine.max_model_len - 1)
    assert engine.requests[rid].max_tokens == 1
    engine.abort(rid)
    _assert_idle(llm)


def test_a_bad_prompt_in_a_batch_leaves_nothing_behind(llm):
    good = [1, 2, 3]
    with pytest.raises(ValueError, match="max_model_len"):
        llm.generate([good, [100] * llm.engine.max_model_len], use_tqdm=False)
    _assert_idle(llm)
