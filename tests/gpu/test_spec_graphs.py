"""Speculative decoding on CUDA: greedy output with decode CUDA graphs on equals output with them off
(`enforce_eager`), token for token, in fp32, and equals output without speculation.

- ngram on a dense model (random tiny Qwen3): a verify step's rows run as decode rows, so they replay
  the decode graphs (checked: some replays carry verify rows).
- mtp on the tiny random Qwen3.5 with its MTP head: the engine keeps graphs off with this drafter (it
  reads the target's hidden states of every step), so both runs are eager; the test holds the CUDA path
  to the plain output, and holds graphs-on to graphs-off once the drafter allows them.

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


def test_mtp_graphs_on_equals_graphs_off():
    model = "random:qwen3.5-tiny"
    plain = _generate(_engine(model, None, eager=True))
    assert _generate(_engine(model, MTP, eager=True)) == plain
    graphed = _engine(model, MTP, eager=False)
    assert _generate(graphed) == plain
    assert graphed.spec is not None and graphed.spec.stats().num_drafts > 0
