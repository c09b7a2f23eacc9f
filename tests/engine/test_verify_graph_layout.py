"""A hybrid model's verify step laid out as decode rows (engine/verify_graphs.py), checked on the CPU
without graphs: the same step run eagerly (each chunk a prompt chunk, the chunked gated delta rule)
and run over the graphs' static inputs (runs of decode rows, the linear-attention states advanced one
run after another) give the same logits at the sampled rows, the same final hidden states, the same
recurrent state and conv window in every request's slot and the same K/V at every computed position,
for a step that mixes a verify chunk, a re-computed chunk with drafts and a plain decode."""

from __future__ import annotations

import pytest
import torch

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.llm import LLM
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.engine.verify_graphs import VerifyGraphs, verify_graph_shapes, verify_layout

PROMPT_LENS = (5, 19, 40)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def engine() -> LLMEngine:
    config = EngineConfig(model="random:qwen3.5-tiny", device="cpu", dtype="float32", max_model_len=128,
                          max_num_seqs=4, kv_cache_bytes=4 * 2**20, enable_prefix_caching=False,
                          progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=None)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    gen = torch.Generator().manual_seed(2)
    for n in PROMPT_LENS:
        engine.add_request(torch.randint(3, 200, (n,), generator=gen).tolist(), params)
    while any(len(r.output_token_ids) < 3 for r in engine.requests.values()):
        engine.step()  # three tokens each: the last two count as uncomputed in the step below
    return engine


def _chunks(engine: LLMEngine) -> list[ScheduledChunk]:
    """A verify chunk (1 known token, 3 drafts), a re-computed one (2 known, 2 drafts), a decode."""
    a, b, c = sorted(engine.requests.values(), key=lambda r: r.num_prompt_tokens)
    blocks = engine.scheduler.block_manager
    b.num_computed_tokens -= 1  # two known tokens, as a chunk computed again after a rejected draft
    chunks = [
        ScheduledChunk(a, a.num_computed_tokens, 4, (11, 12, 13)),
        ScheduledChunk(b, b.num_computed_tokens, 4, (21, 22)),
        ScheduledChunk(c, c.num_computed_tokens, 1),
    ]
    for ch in chunks:
        assert blocks.allocate(ch.request, ch.start + ch.num_tokens - ch.request.num_computed_tokens)
    return chunks


def test_shapes():
    assert verify_graph_shapes(1, 16, 8) == sorted(
        [(w, s) for w in (1, 2, 4, 8) for s in (2, 3)], key=lambda ws: -ws[0] * ws[1]
    )
    assert {s for _, s in verify_graph_shapes(16, 4, None)} == set(range(2, 10))
    assert {w for w, _ in verify_graph_shapes(2, 4, None)} == {1, 2, 4}
    assert {w for w, _ in verify_graph_shapes(2, 64, 3)} == {1, 2, 3}


def test_verify_step_as_decode_rows_equals_eager(engine):
    runner, pool = engine.runner, engine.pool
    chunks = _chunks(engine)
    scratch_block = pool.allocate(1)[0]
    scratch_slot = engine.states.allocate()
    assert scratch_slot is not None
    slots = [ch.request.state_slot for ch in chunks]
    kv0 = runner.kv_cache.clone()
    states0 = {name: t.clone() for name, t in runner.states.items()}
    runner.keep_hidden = True

    logits_e, order_e = runner.execute(chunks)
    hidden_e = runner.last_hidden
    kv_e, states_e = runner.kv_cache.clone(), {name: t.clone() for name, t in runner.states.items()}

    runner.kv_cache.copy_(kv0)
    for name, t in runner.states.items():
        t.copy_(states0[name])
    graphs = VerifyGraphs(runner, [(4, 4), (4, 2)], 128, scratch_block, scratch_slot)
    graphs.graphs[(4, 4)] = graphs.graphs[(4, 2)] = None  # type: ignore[assignment]  # as if captured
    assert graphs.shape(chunks) == (4, 4)
    assert graphs.shape(chunks[2:]) is None  # decodes alone: the decode graphs' step
    layout = verify_layout(chunks, 4, 4, runner.block_size, graphs.pad_row, scratch_block)
    graphs.load(layout)
    with torch.inference_mode():
        hidden, logits = graphs.forward(4, 4)

    assert [ch.request for ch in layout.chunks] == [ch.request for ch in order_e]
    assert len(layout.sample) == 4 + 3 + 1
    torch.testing.assert_close(logits[layout.sample], logits_e, rtol=1e-4, atol=1e-4)
    assert logits[layout.sample].argmax(-1).tolist() == logits_e.argmax(-1).tolist()
    torch.testing.assert_close(hidden[layout.hidden], hidden_e, rtol=1e-4, atol=1e-4)
    for name, t in runner.states.items():
        torch.testing.assert_close(t[slots], states_e[name][slots], rtol=1e-4, atol=1e-5)
    bs = runner.block_size
    for ch in chunks:  # the K/V of every position the step computed, and of those before it
        pos = torch.arange(ch.start + ch.num_tokens)
        blk, off = torch.tensor(ch.request.block_ids)[pos // bs], pos % bs
        torch.testing.assert_close(
            runner.kv_cache[blk, :, :, off], kv_e[blk, :, :, off], rtol=1e-4, atol=1e-5
        )
    engine.states.free(scratch_slot)
    pool.free([scratch_block])


class _Replay:
    """A stand-in for a captured graph on the CPU: runs the forward over the static inputs and writes
    the shared outputs, as the graph's replay does."""

    def __init__(self, graphs: VerifyGraphs, width: int, steps: int) -> None:
        self.graphs, self.width, self.steps = graphs, width, steps

    def replay(self) -> None:
        n = self.width * self.steps
        hidden, logits = self.graphs.forward(self.width, self.steps)
        self.graphs.logits[:n].copy_(logits)  # type: ignore[index]
        self.graphs.hidden[:n].copy_(hidden)  # type: ignore[index]


def _with_replays(engine: LLMEngine, k: int) -> VerifyGraphs:
    """The engine's runner with verify "graphs" that run eagerly (`_Replay`), over a block and a state
    slot taken from its pools as the scratch ones."""
    runner = engine.runner
    block, slot = engine.pool.allocate(1)[0], engine.states.allocate()
    assert slot is not None
    shapes = verify_graph_shapes(k, 4, None)
    graphs = VerifyGraphs(runner, shapes, engine.max_model_len, block, slot)
    vocab, hidden = engine.model_config.vocab_size, engine.model_config.hidden_size
    graphs.logits = torch.empty(graphs.max_rows, vocab)
    graphs.hidden = torch.empty(graphs.max_rows, hidden)
    for w, s in shapes:
        graphs.graphs[(w, s)] = _Replay(graphs, w, s)  # type: ignore[assignment]
    runner.verify_graphs = graphs
    return graphs


MTP = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}
NGRAM = {
    "method": "ngram",
    "num_speculative_tokens": 3,
    "prompt_lookup_min": 1,
    "disable_by_batch_size": None,
}


def _generate(spec: dict | None, replays: bool) -> tuple[list[list[int]], list[list[int]], int]:
    """Greedy tokens of two prompts that repeat themselves, the drafts taken at each step, and the
    verify layout's replays; with `replays`, through `_with_replays`."""
    config = EngineConfig(model="random:qwen3.5-tiny", device="cpu", dtype="float32", max_model_len=128,
                          max_num_seqs=4, kv_cache_bytes=4 * 2**20, enable_prefix_caching=False,
                          speculative_config=spec, progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=None)
    graphs = _with_replays(engine, spec["num_speculative_tokens"]) if spec and replays else None
    drafts: list[list[int]] = []
    mtp = engine.spec.mtp if engine.spec is not None else None
    if mtp is not None:  # the MTP drafts come from the hidden states the verify layout hands over
        take = mtp.take
        mtp.take = lambda req: drafts.append(take(req)) or drafts[-1]  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    gen = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 60, (n,), generator=gen).tolist() for n in (6, 23)]
    batch = [{"prompt_token_ids": p + p} for p in prompts]  # text to quote for the n-gram drafter
    outs = LLM.from_engine(engine).generate(batch, params, use_tqdm=False)
    assert not engine.has_unfinished_requests()
    return [o.outputs[0].token_ids for o in outs], drafts, graphs.replays if graphs is not None else 0


@pytest.mark.parametrize("spec", [MTP, NGRAM], ids=["mtp", "ngram"])
def test_generation_through_the_verify_layout_equals_plain(spec):
    """Whole greedy generations (rollbacks, the MTP drafter's hidden states) with every verify step that
    fits run through `VerifyGraphs.run`: the tokens of speculation off."""
    plain, _, _ = _generate(None, False)
    tokens, drafts, replays = _generate(spec, True)
    assert tokens == plain
    assert replays > 0
