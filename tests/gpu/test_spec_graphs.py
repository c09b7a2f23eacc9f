"""Speculative decoding on CUDA: greedy output with CUDA graphs on equals output with them off
(`enforce_eager`), token for token, in fp32, and equals output without speculation.

- ngram on a dense model (random tiny Qwen3): a verify step's rows run as decode rows, so they replay
  the decode graphs (checked: some replays carry verify rows).
- ngram and mtp on the tiny random Qwen3.5 (mtp with its random MTP head): verify steps replay the
  hybrid verify graphs (engine/verify_graphs.py; checked: they replayed), plain decode steps the
  decode graphs, and the MTP drafter reads the target's hidden states from both.
- every draft rejected on the tiny Qwen3.5 with graphs on: the recurrent state, the conv window and the
  KV at each computed position equal those of a run without drafts, and the tokens are the same.

Skipped without a GPU; on a GPU machine: `python -m pytest tests/gpu/test_spec_graphs.py -q`.
"""

from __future__ import annotations

import pytest
import torch

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.llm import LLM
from splitserve.engine.spec.rows import VerifyRow

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3}
MTP = {"method": "mtp", "num_speculative_tokens": 2}


def _prompts() -> list[list[int]]:
    """Prompts that repeat themselves (n-gram drafts find matches) and five of them, so decode steps pad
    to a graph of batch 8 and verify rows to larger ones."""
    g = torch.Generator().manual_seed(1)
    rand = [torch.randint(3, 500, (n,), generator=g).tolist() for n in (7, 33, 61)]
    return [*rand, [(7 * i) % 512 for i in range(512)], [5, 17, 300, 42, 7, 99, 250, 5, 17, 300, 42, 7]]


def _engine(model: str, spec: dict | None, eager: bool) -> LLMEngine:
    config = EngineConfig(model=model, device="cuda", dtype="float32", max_model_len=1024, max_num_seqs=16,
                          kv_cache_bytes=64 << 20, speculative_config=spec, enforce_eager=eager,
                          progress=False)  # fmt: skip
    return LLMEngine(config, tokenizer=None)


def _generate(engine: LLMEngine) -> list[list[int]]:
    outs = LLM.from_engine(engine).generate([{"prompt_token_ids": p} for p in _prompts()], GREEDY,
                                            use_tqdm=False)  # fmt: skip
    assert engine.pool.num_free == engine.pool.num_blocks
    return [o.outputs[0].token_ids for o in outs]


def _count_verify_replays(engine: LLMEngine) -> list[int]:
    """Count the graph replays whose rows include a verify row."""
    graphs = engine.runner.graphs
    assert graphs is not None, "decode CUDA graphs are off"
    seen = [0]
    run = graphs.run

    def counting(chunks, feed=None):
        seen[0] += any(isinstance(c, VerifyRow) for c in chunks)
        return run(chunks, feed)

    graphs.run = counting  # type: ignore[method-assign]
    return seen


def test_ngram_verify_steps_replay_the_decode_graphs_token_exact():
    model = "random:tiny"
    plain = _generate(_engine(model, None, eager=True))
    eager = _engine(model, NGRAM, eager=True)
    assert eager.runner.graphs is None
    graphed = _engine(model, NGRAM, eager=False)
    replays = _count_verify_replays(graphed)
    assert _generate(eager) == plain
    assert _generate(graphed) == plain
    assert replays[0] > 0  # verify steps ran as graph replays
    assert graphed.spec is not None and graphed.spec.stats().num_drafts > 0


def test_hybrid_ngram_verify_steps_replay_the_verify_graphs_token_exact():
    model = "random:qwen3.5-tiny"
    plain = _generate(_engine(model, None, eager=True))
    eager = _engine(model, NGRAM, eager=True)
    assert eager.runner.verify_graphs is None
    graphed = _engine(model, NGRAM, eager=False)
    assert graphed.runner.verify_graphs is not None
    assert _generate(eager) == plain
    assert _generate(graphed) == plain
    assert graphed.runner.verify_graphs.replays > 0
    assert graphed.spec is not None and graphed.spec.stats().num_drafts > 0


def test_mtp_graphs_on_equals_graphs_off():
    model = "random:qwen3.5-tiny"
    plain = _generate(_engine(model, None, eager=True))
    assert _generate(_engine(model, MTP, eager=True)) == plain
    graphed = _engine(model, MTP, eager=False)
    assert graphed.runner.graphs is not None and graphed.runner.verify_graphs is not None
    assert graphed.runner.keep_hidden
    assert _generate(graphed) == plain
    assert graphed.runner.verify_graphs.replays > 0
    assert graphed.spec is not None and graphed.spec.stats().num_drafts > 0


class _WrongDrafts:
    """Proposes the known greedy continuation of one prompt with every token changed: every draft of
    every verify step is rejected."""

    def __init__(self, prompt: list[int], ref: list[int]) -> None:
        self.prompt, self.ref = prompt, ref

    def propose(self, tokens, k: int) -> list[int]:  # noqa: ANN001
        done = len(tokens) - len(self.prompt)
        return [(t + 1) % 500 for t in self.ref[done : done + k]]


def _trace(engine: LLMEngine, prompt: list[int]) -> tuple[list[int], dict[int, tuple]]:
    """One request alone, a step at a time; -> its tokens, and computed length -> (KV, states) after
    each step."""
    rid = engine.add_request(prompt, GREEDY)
    req = engine.requests[rid]
    tokens: list[int] = []
    snaps: dict[int, tuple] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if req.finished:
            break
        n = req.num_computed_tokens
        kv = engine.kv_cache[req.block_ids].permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :n].clone()
        snaps[n] = (kv, {k: t[req.state_slot].clone() for k, t in engine.states.states.items()})
    return tokens, snaps


def test_hybrid_every_draft_rejected_with_graphs_restores_state():
    model = "random:qwen3.5-tiny"
    prompt = _prompts()[1]
    tokens, plain = _trace(_engine(model, None, eager=True), prompt)
    graphed = _engine(model, {**NGRAM, "disable_by_batch_size": None}, eager=False)
    assert graphed.spec is not None and graphed.runner.verify_graphs is not None
    graphed.spec.drafter = _WrongDrafts(prompt, tokens)
    spec_tokens, snaps = _trace(graphed, prompt)
    assert spec_tokens == tokens
    stats = graphed.spec.stats()
    assert stats.num_drafts > 3 and stats.num_accepted_tokens == 0
    assert graphed.runner.verify_graphs.replays > 0
    compared = 0
    for n, (kv, states) in snaps.items():
        if n not in plain:
            continue
        want_kv, want_states = plain[n]
        for name, t in states.items():
            torch.testing.assert_close(t, want_states[name], rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(kv, want_kv, rtol=1e-4, atol=1e-4)
        compared += 1
    assert compared >= len(snaps) // 2
