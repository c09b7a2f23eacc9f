"""Speculative decoding on a hybrid model (Qwen3.5: Gated DeltaNet + gated attention), tiny random
weights, fp32 CPU: greedy output with drafts verified equals output without them, token for token,
with runs that accept some drafts and reject the rest; with every draft rejected, the recurrent
state, the conv window and the attention layers' KV at each computed position equal those of a run
without drafts, and every state slot and block comes back."""

from __future__ import annotations

import pytest
import torch
from spec_helpers import OracleDrafter, trace
from tiny_configs import TINY_QWEN3_5

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.llm import LLM

PROMPT_LENS = (3, 17, 41, 70)
MAX_NEW = 20
GREEDY = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
SPEC = {"method": "ngram", "num_speculative_tokens": 3, "disable_by_batch_size": None}


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def loaded(tiny_qwen, tiny_qwen_loaded):
    """The tiny Qwen3.5 checkpoint's path and its loaded weights (the shared session fixtures)."""
    return tiny_qwen, tiny_qwen_loaded


@pytest.fixture(scope="module")
def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    return [torch.randint(0, TINY_QWEN3_5["vocab_size"], (n,), generator=gen).tolist() for n in PROMPT_LENS]


def _engine(loaded, **knobs) -> LLMEngine:
    path, model = loaded
    config = EngineConfig(model=str(path), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
                          kv_cache_bytes=4 * 2**20, progress=False, **knobs)  # fmt: skip
    return LLMEngine(config, tokenizer=None, loaded=model)


def _generate(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    batch = [{"prompt_token_ids": p} for p in prompts]
    outs = LLM.from_engine(engine).generate(batch, GREEDY, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.states.num_free == engine.states.num_slots > 0
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def plain(loaded, prompts) -> list[list[int]]:
    return _generate(_engine(loaded), prompts)


@pytest.mark.parametrize("wrong_every", [3, 4])
def test_hybrid_greedy_with_drafts_equals_plain(loaded, prompts, plain, wrong_every):
    engine = _engine(loaded, speculative_config=SPEC)
    engine.spec.drafter = OracleDrafter(prompts, plain, TINY_QWEN3_5["vocab_size"], wrong_every)
    assert _generate(engine, prompts) == plain
    stats = engine.stats().spec_decode
    assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens


def test_hybrid_ngram_equals_plain(loaded, prompts):
    repeated = [p + p[: len(p) // 2] for p in prompts]
    engine = _engine(loaded, speculative_config={**SPEC, "prompt_lookup_min": 1})
    assert _generate(engine, repeated) == _generate(_engine(loaded), repeated)
    assert engine.stats().spec_decode.num_drafts > 0


def test_hybrid_every_draft_rejected_restores_state(loaded, prompts, plain):
    prompt, ref = prompts[2], plain[2]
    plain_tokens, plain_snaps = trace(_engine(loaded), prompt, GREEDY)
    engine = _engine(loaded, speculative_config=SPEC)
    engine.spec.drafter = OracleDrafter([prompt], [ref], TINY_QWEN3_5["vocab_size"], wrong_every=1)
    tokens, snaps = trace(engine, prompt, GREEDY)
    assert tokens == plain_tokens == ref
    stats = engine.stats().spec_decode
    assert stats.num_drafts > 3 and stats.num_accepted_tokens == 0
    by_computed = {s.computed: s for s in plain_snaps}
    compared = 0
    for s in snaps:
        if s.computed not in by_computed:
            continue  # after a restore the request stands at an earlier position than any plain step
        want = by_computed[s.computed]
        assert set(s.states) == {"conv", "recurrent"}
        for name, t in s.states.items():
            torch.testing.assert_close(t, want.states[name], rtol=1e-5, atol=1e-5)
        # recomputed in a multi-token chunk (the chunked delta rule), where the plain run decoded
        torch.testing.assert_close(s.kv, want.kv, rtol=1e-4, atol=1e-4)
        compared += 1
    assert compared >= len(snaps) // 2
