"""Speculative decoding across the split, in one process (tiny random Qwen3.5 with its MTP head, tcp):
the decode engine verifies drafts from a request's first step after its KV was imported, with `ngram`
(prompt lookup over the prompt and the first token) and with `mtp` (from the head's state at the last
prompt position, which travels in the request's state slot beside the recurrent state); the output
equals the output without speculation, token for token. Imported prompts' blocks keep the head's K/V
in the decode engine's prefix cache, its head backed off or not."""

from __future__ import annotations

import pytest
from kv_transfer_helpers import SECRET
from tp_pd_engines import colocated, disaggregated
from tp_pd_engines import run as _run

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.block_pool import ROOT_HASH, extend_chain
from splitserve.engine.engine import LLMEngine
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.spec.verify import SpecDecoder
from splitserve.model.qwen3_5_mtp import STATE
from splitserve.transport import TransportOptions

MODEL = "random:qwen3.5-tiny"
VOCAB = 512
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
# every token of the vocabulary occurs in the first two prompts: whatever the first token, a lookup finds it
PROMPTS = [[(7 * i) % VOCAB for i in range(VOCAB)], [(11 * i + 3) % VOCAB for i in range(VOCAB)],
           [5, 17, 300, 42, 7, 99, 250, 5, 17, 300, 42, 7]]  # fmt: skip

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _engine(spec: dict | None, **knobs) -> LLMEngine:
    config = EngineConfig(model=MODEL, device="cpu", dtype="float32", max_model_len=1024, max_num_seqs=4,
                          kv_cache_bytes=8 << 20, speculative_config=spec, progress=False,
                          **knobs)  # fmt: skip
    return LLMEngine(config, tokenizer=None)


def _first_step_drafts(engine: LLMEngine) -> dict[tuple[int, ...], tuple[int, ...]]:
    """Record the drafts each request verifies at its first decode step, by prompt."""
    seen: dict[tuple[int, ...], tuple[int, ...]] = {}
    spec = engine.spec
    assert spec is not None
    accept = spec._accept

    def recording(c, rows, sampler):
        req = c.request
        if c.start == req.num_prompt_tokens and len(req.output_token_ids) == 1:
            seen[tuple(req.prompt_token_ids)] = c.drafts
        return accept(c, rows, sampler)

    spec._accept = recording  # type: ignore[method-assign]
    return seen


def _colocated(engine: LLMEngine) -> list[list[int]]:
    return colocated(engine, PROMPTS, GREEDY)


def _split(prefill: LLMEngine, decode: LLMEngine) -> list[list[int]]:
    options = TransportOptions(lease_s=30.0, fetch_timeout_s=5.0)
    conns = [KVConnector.open(e, "tcp", secret=SECRET, options=options) for e in (prefill, decode)]
    try:
        return disaggregated(prefill, decode, PROMPTS, "s", GREEDY)
    finally:
        for conn in conns:
            conn.close()


@pytest.fixture(scope="module")
def plain() -> list[list[int]]:
    return _colocated(_engine(None))


@pytest.mark.parametrize("spec", [NGRAM, MTP], ids=["ngram", "mtp"])
def test_decode_verifies_drafts_from_its_first_step_after_the_import(plain, spec):
    colocated = _engine(spec)
    want = _first_step_drafts(colocated)
    assert _colocated(colocated) == plain
    prefill, decode = _engine(spec), _engine(spec)
    got = _first_step_drafts(decode)
    assert _split(prefill, decode) == plain
    stats = decode.spec.stats() if isinstance(decode.spec, SpecDecoder) else None
    assert got == want  # the same drafts as after a local prefill (mtp: the head's state came along)
    assert stats is not None and stats.num_first_step_drafts == len(got) >= 2
    assert all(len(d) == spec["num_speculative_tokens"] for d in got.values())
    assert prefill.spec.stats().num_drafts == 0  # a prefill engine stops at the first token


def test_a_prefill_engine_past_its_cap_still_hands_the_heads_context_over(plain):
    """The MTP head's back-off (spec/verify.py) spares a KV export: a prefill engine whose batch is past
    the drafting cap beyond the head's grace still catches up over the prompts it exports, so the
    decode engine drafts the same first drafts as after a local prefill."""
    colocated = _engine(MTP)
    want = _first_step_drafts(colocated)
    assert _colocated(colocated) == plain
    # prompts in chunks of 128 tokens: several steps with requests running, each past the cap
    prefill = _engine({**MTP, "disable_by_batch_size": 1}, max_num_batched_tokens=128)
    decode = _engine(MTP)
    prefill.spec.head_grace = 0
    head_on = []
    catches_up = prefill.spec.catches_up

    def recording(sched):  # noqa: ANN001, ANN202
        head_on.append(prefill.spec.head_on)
        return catches_up(sched)

    prefill.spec.catches_up = recording  # type: ignore[method-assign]
    got = _first_step_drafts(decode)
    assert _split(prefill, decode) == plain
    assert False in head_on  # some prompt chunks ran with the head backed off
    assert got == want and prefill.spec.stats().num_head_lost == 0


def test_the_heads_state_travels_in_the_layout():
    """The MTP head's state is part of the state slots a KV export carries, so the handshake's layout
    (and its fingerprint) differs from an engine's without it."""
    with_head, without = _engine(MTP), _engine(None)
    assert with_head.state_shapes[STATE] == ((64,), with_head.dtype)
    assert STATE not in without.state_shapes
    assert with_head.states.states[STATE].shape[1:] == (64,)


def test_a_decode_engine_past_its_cap_caches_imported_prompts_with_the_heads_kv(plain):
    """Requests imported while the decode engine's head is backed off lose their head context at their
    first step, but their prompts' blocks carry the prefill engine's head K/V: the prefix cache keeps
    them as blocks with it (block_pool.py `headless`), so a later request that drafts may reuse them."""
    prefill = _engine(MTP)
    decode = _engine({**MTP, "disable_by_batch_size": 1})
    decode.spec.head_grace = 0
    options = TransportOptions(lease_s=30.0, fetch_timeout_s=5.0)
    conns = [KVConnector.open(e, "tcp", secret=SECRET, options=options) for e in (prefill, decode)]
    try:
        for i, p in enumerate(PROMPTS):
            prefill.add_request(p, GREEDY, request_id=f"r{i}", kv_transfer="export")
        outs = _run(prefill)

        def add(i: int) -> None:
            first = outs[f"r{i}"].outputs[0].token_ids[0]
            decode.add_request_with_kv(outs[f"r{i}"].kv_export.handle, PROMPTS[i], first, GREEDY, f"d{i}")

        done = {}
        add(2)
        for _ in range(4):  # the short one runs alone: at the cap, past the grace
            done.update((o.request_id, o) for o in decode.step() if o.finished)
            if not decode.spec.head_on:
                break
        assert not decode.spec.head_on and not done
        add(0)
        add(1)
        done.update(_run(decode))
    finally:
        for conn in conns:
            conn.close()
    assert [done[f"d{i}"].outputs[0].token_ids for i in range(len(PROMPTS))] == plain
    assert decode.spec.stats().num_head_lost == len(PROMPTS)
    pool = decode.scheduler.block_manager.pool
    for p in PROMPTS[:2]:
        hashes = extend_chain(ROOT_HASH, p, decode.scheduler.block_manager.block_size)
        blocks = pool.lookup(hashes)
        assert len(blocks) == len(hashes) and not set(blocks) & pool.headless
