"""Prefix caching with the MTP head's back-off (engine/spec/verify.py, block_manager.py) on the tiny
random Qwen3.5 with its random MTP head, fp32 CPU. A busy batch keeps the head backed off past its
grace while two requests with a shared prefix run: the first leaves that prefix's blocks in the cache
without the head's K/V, the second checkpoints the recurrent state at their end. Once the batch has
drained, a request that does not draft (logprobs) reuses the prefix and loses its head context; a
request that drafts does not reuse it, computes it with the head, and its copy takes the cache's
place; the next request that drafts reuses that copy and keeps its head context. Greedy output equals
output without speculation token for token."""

from __future__ import annotations

import pytest

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.block_pool import ROOT_HASH, extend_chain
from splitserve.engine.engine import LLMEngine

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

CAP, GRACE, K, BLOCK = 4, 2, 2, 16
MTP = {"method": "mtp", "num_speculative_tokens": K, "disable_by_batch_size": CAP}
SHARED = [(13 * i + 5) % 500 + 3 for i in range(2 * BLOCK)]  # two whole blocks
BUSY = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (9, 14, 20, 11, 25)]
TAILS = {name: [(17 * i + 31 * n) % 500 + 3 for i in range(n)]
         for n, name in enumerate(("first", "second", "logprobs", "drafts", "again"), 3)}  # fmt: skip
MAX_TOKENS = 30  # the busy requests': the batch stays over the cap while the shared prefix runs


def _engine(spec: dict | None, caching: bool) -> LLMEngine:
    config = EngineConfig(model="random:qwen3.5-tiny", device="cpu", dtype="float32", max_model_len=128,
                          max_num_seqs=8, kv_cache_bytes=4 << 20, enable_prefix_caching=caching,
                          speculative_config=spec, progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=None)
    if engine.spec is not None:
        engine.spec.head_grace = GRACE
    return engine


def _params(name: str) -> SamplingParams:
    n = MAX_TOKENS if name.startswith("busy") else 6
    return SamplingParams(
        temperature=0, max_tokens=n, ignore_eos=True, logprobs=1 if name == "logprobs" else None
    )


class _Scenario:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokens: dict[str, list[int]] = {}
        self.reqs = {}
        self.drafts: dict[str, int] = {}  # verify runs of each later request

    def add(self, name: str) -> None:
        prompt = BUSY[int(name[4:])] if name.startswith("busy") else SHARED + TAILS[name]
        rid = self.engine.add_request(prompt, _params(name), request_id=name)
        self.reqs[name] = self.engine.requests[rid]

    def step(self) -> None:
        for out in self.engine.step():
            self.tokens[out.request_id] = list(out.outputs[0].token_ids)

    def drain(self) -> None:
        while self.engine.has_unfinished_requests():
            self.step()

    def busy(self) -> _Scenario:
        """The shared prefix computed while the head is backed off past its grace."""
        spec = self.engine.spec
        for i in range(len(BUSY)):
            self.add(f"busy{i}")
        self.step()
        while spec is not None and spec.head_on:  # over the cap, within the grace
            self.step()
        self.add("first")
        self.step()  # its prompt computed while the head is off
        self.add("second")  # stops at the shared blocks' end to checkpoint the state there
        self.drain()
        return self

    def later(self) -> _Scenario:
        """One at a time, the head on: the requests that reuse the shared prefix or not."""
        spec = self.engine.spec
        for name in ("logprobs", "drafts", "again"):
            before = spec.counters.num_drafts if spec is not None else 0
            self.add(name)
            self.drain()
            self.drafts[name] = (spec.counters.num_drafts if spec is not None else 0) - before
        return self


def _shared_blocks(engine: LLMEngine) -> list[int]:
    """The blocks the prefix cache holds for the shared prefix."""
    hashes = extend_chain(ROOT_HASH, SHARED, BLOCK)
    blocks = engine.scheduler.block_manager.pool.lookup(hashes)
    assert len(blocks) == len(hashes)
    return blocks


def test_blocks_without_the_heads_kv_are_reused_only_by_requests_that_do_not_draft():
    plain = _Scenario(_engine(None, caching=False)).busy().later()
    engine = _engine(MTP, caching=True)
    assert engine.scheduler.block_manager.block_size == BLOCK
    pool = engine.scheduler.block_manager.pool
    got = _Scenario(engine).busy()
    reqs = got.reqs
    assert reqs["first"].head_lost and reqs["second"].head_lost
    assert reqs["second"].num_cached_tokens == 0  # a KV hit without a state checkpoint: none yet
    assert set(_shared_blocks(engine)) <= pool.headless  # computed without the head's K/V
    got.later()
    assert got.tokens == plain.tokens
    # a request that does not draft reuses the prefix (to its checkpoint) and loses the head's context
    assert reqs["logprobs"].num_cached_tokens == len(SHARED) and reqs["logprobs"].head_lost
    # one that drafts computes it afresh, with the head; its copy replaces the cached one
    assert reqs["drafts"].num_cached_tokens == 0 and not reqs["drafts"].head_lost
    assert got.drafts["drafts"] > 0
    assert not set(_shared_blocks(engine)) & pool.headless
    # and the next one reuses that copy, drafting
    assert reqs["again"].num_cached_tokens == len(SHARED) and not reqs["again"].head_lost
    assert got.drafts["again"] > 0
    stats = engine.stats().spec_decode
    assert stats.num_head_lost == len(BUSY) + 3  # the busy batch, the two shared ones, the logprobs one
