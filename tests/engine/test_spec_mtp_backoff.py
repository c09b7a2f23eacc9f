"""The MTP head's back-off (engine/spec/verify.py) on the tiny random Qwen3.5 with its random MTP head,
fp32 CPU: a batch goes over the drafting cap beyond the head's grace and comes back under it. While
over it past the grace the head does not run at all (its forward calls counted, eager and through
stand-ins of the CUDA graphs), the requests of those steps lose their head context and never draft
again, a request that arrives once the batch is under the cap drafts, and greedy output equals output
without speculation token for token."""

from __future__ import annotations

from collections import Counter

import pytest
from graph_stand_ins import stand_ins
from spec_forcing import forced_accept

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.spec import verify

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py

CAP, GRACE, K = 4, 2, 2
MTP = {"method": "mtp", "num_speculative_tokens": K, "disable_by_batch_size": CAP}
PROMPTS = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in (9, 14, 20, 11, 25, 17)]
SHORT, LONG, LATE = (0, 1, 2), (3, 4), 5  # five at once (over the cap), the sixth once the short end
MAX_TOKENS = {0: 16, 1: 16, 2: 16, 3: 40, 4: 40, 5: 16}


def _engine(spec: dict | None) -> LLMEngine:
    config = EngineConfig(model="random:qwen3.5-tiny", device="cpu", dtype="float32", max_model_len=128,
                          max_num_seqs=8, kv_cache_bytes=4 << 20, enable_prefix_caching=False,
                          speculative_config=spec, progress=False)  # fmt: skip
    return LLMEngine(config, tokenizer=None)


class _Run:
    """One run of the scenario: the tokens of each prompt, and per step whether the head was backed off
    past its grace and how many times its forward ran."""

    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self.tokens: dict[int, list[int]] = {}
        self.steps: list[tuple[bool, int]] = []  # (backed off past the grace, the head's forward calls)
        self.verified: Counter = Counter()  # verify runs by prompt index
        self.reqs = {}
        self.late = [0, 0]  # the steps from the late request's arrival to its end

    def add(self, i: int) -> None:
        params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS[i], ignore_eos=True)
        rid = self.engine.add_request(PROMPTS[i], params, request_id=f"p{i}")
        self.reqs[i] = self.engine.requests[rid]

    def go(self) -> _Run:
        engine, spec = self.engine, self.engine.spec
        calls = Counter()
        if spec is not None:
            spec.mtp.head.register_forward_hook(lambda *_: calls.update(["head"]))
            accept = spec._accept

            def recording(c, rows, sampler):  # noqa: ANN001, ANN202
                self.verified[int(c.request.request_id[1:])] += 1
                return accept(c, rows, sampler)

            spec._accept = recording  # type: ignore[method-assign]
        for i in (*SHORT, *LONG):
            self.add(i)
        while engine.has_unfinished_requests():
            before = calls["head"]
            for out in engine.step():
                self.tokens[int(out.request_id[1:])] = list(out.outputs[0].token_ids)
            off = spec is not None and not spec.head_on
            self.steps.append((off, calls["head"] - before))
            if LATE not in self.reqs and all(self.reqs[i].finished for i in SHORT):
                self.add(LATE)
                self.late[0] = len(self.steps)
            if LATE in self.reqs and self.reqs[LATE].finished and not self.late[1]:
                self.late[1] = len(self.steps)
        return self


def _mtp(graphs: bool) -> tuple[LLMEngine, Counter]:
    engine = _engine(MTP)
    engine.spec.head_grace = GRACE
    return engine, stand_ins(engine, K, head=True, batch=8) if graphs else Counter()


@pytest.fixture(scope="module")
def plain() -> _Run:
    return _Run(_engine(None)).go()


@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graphs"])
def test_the_head_stops_past_its_grace_and_output_equals_plain(plain, graphs):
    engine, replays = _mtp(graphs)
    run = _Run(engine).go()
    assert run.tokens == plain.tokens
    off = [calls for was_off, calls in run.steps if was_off]
    assert len(off) > 10 and not any(off)  # backed off: the head never ran
    grace = [calls for was_off, calls in run.steps[1 : 1 + GRACE]]  # over the cap, within the grace
    assert all(calls > 0 for calls in grace)
    start, end = run.late
    assert 0 < start < end < len(run.steps)  # the long requests outlive the late one
    assert sum(calls for _, calls in run.steps[start:end]) > 0  # the head runs for the late request
    assert not any(calls for _, calls in run.steps[end:])  # and not for requests that lost it
    for i in (*SHORT, *LONG):
        assert run.reqs[i].head_lost and run.verified[i] == 0
    assert not run.reqs[LATE].head_lost and run.verified[LATE] > 0
    stats = engine.stats().spec_decode
    assert stats.num_head_lost == len(SHORT) + len(LONG)
    assert stats.num_drafts == run.verified[LATE] and stats.num_draft_tokens >= stats.num_drafts
    if graphs:
        assert replays["catch-up decode"] > 0 and replays["drafts"] > 0


def test_requests_that_lost_the_head_go_on_plain_while_a_new_one_accepts(monkeypatch):
    """With acceptance forced (random weights accept nothing by themselves), the late request's drafts
    are accepted, and the requests that lost the head context never verify a draft."""
    monkeypatch.setattr(verify, "accept_greedy", forced_accept(0.8))
    engine, _ = _mtp(graphs=False)
    run = _Run(engine).go()
    stats = engine.stats().spec_decode
    assert stats.num_accepted_tokens > 0 and sum(stats.accepted_per_pos) == stats.num_accepted_tokens
    assert set(run.verified) == {LATE}
    assert len(run.tokens[LATE]) == MAX_TOKENS[LATE]
