"""The scheduler without a model: fake requests, and steps simulated the way
`Scheduler.update_from_output` applies them (computed tokens bumped, a token appended where a chunk
samples, full blocks cached, finished requests freed). A fake KV cache records which token each slot
holds, so that a chunk reading a block that another request overwrote, or a wrong prefix-cache hit,
is caught without running a model."""

from __future__ import annotations

import random

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.request import Request, Status
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.sampling.params import SamplingParams

BS = 4


class Sim:
    """A scheduler plus the engine's bookkeeping, with invariant checks after every step."""

    def __init__(self, num_blocks: int, max_num_seqs: int = 8, budget: int = 16, caching: bool = True):
        self.pool = BlockPool(num_blocks, caching)
        self.block_manager = BlockManager(self.pool, BS)
        self.sched = Scheduler(self.block_manager, max_num_seqs, budget, max_model_len=1 << 20)
        self.live: dict[str, Request] = {}
        self.finished: list[Request] = []
        self.slots: dict[tuple[int, int], int] = {}  # (block, offset) -> token id whose KV is there
        self._ids = 0
        self.sampled: list[bool] = []  # per chunk of the last step: whether it sampled a token

    def add(self, prompt: list[int], max_tokens: int, rid: str | None = None, **kw) -> Request:
        rid = rid or f"r{self._ids}"
        self._ids += 1
        params = SamplingParams(max_tokens=max_tokens)
        req = Request(rid, list(prompt), params, (), max_tokens, **kw)
        self.live[rid] = req
        self.sched.add(req)
        return req

    def abort(self, req: Request) -> None:
        req.status = Status.FINISHED
        req.finish_reason = "abort"
        self.sched.finish(req)
        del self.live[req.request_id]

    def step(self) -> SchedulerOutput:
        out = self.sched.schedule()
        self._check_schedule(out)
        self.sampled = [c.samples for c in out.chunks]  # (`samples` changes once a token is appended)
        sampling = [c for c, s in zip(out.chunks, self.sampled, strict=True) if s]
        for c in out.chunks:  # "run the model": store this chunk's KV, then read the whole context
            self._store(c.request, c.start, c.start + c.num_tokens)
        for c in out.chunks:
            self._check_context(c.request, c.start + c.num_tokens)
        for c in out.chunks:
            c.request.num_computed_tokens += c.num_tokens
        for c in sampling:
            req = c.request
            req.output_token_ids.append(_fake_token(req))
            if len(req.output_token_ids) >= req.max_tokens:
                req.status = Status.FINISHED
                req.finish_reason = "length"
                self.block_manager.cache_full_blocks(req)
                self.sched.finish(req)
                del self.live[req.request_id]
                self.finished.append(req)
        for c in out.chunks:
            if not c.request.finished:
                self.block_manager.cache_full_blocks(c.request)
        self.check_pool()
        return out

    def drain(self, max_steps: int = 2000) -> None:
        for _ in range(max_steps):
            if not self.sched.has_work():
                return
            self.step()
        raise AssertionError("the scheduler made no progress")

    # ---- invariants -----------------------------------------------------------------------------

    def _check_schedule(self, out: SchedulerOutput) -> None:
        assert out.num_tokens <= self.sched.max_num_batched_tokens
        assert len(self.sched.running) <= self.sched.max_num_seqs
        reqs = [c.request for c in out.chunks]
        assert len(set(map(id, reqs))) == len(reqs), "a request was scheduled twice in one step"
        for c in out.chunks:
            req = c.request
            assert req.status is Status.RUNNING and req in self.sched.running
            assert c.num_tokens >= 1 and c.start == req.num_computed_tokens
            assert c.start + c.num_tokens <= req.num_tokens
            assert len(req.block_ids) >= self.block_manager.blocks_for(c.start + c.num_tokens)
        for req in out.preempted:
            assert req.status is Status.WAITING and req.block_ids == [] and req.num_computed_tokens == 0
            assert req in self.sched.waiting and req not in reqs

    def _store(self, req: Request, start: int, end: int) -> None:
        for pos, tok in zip(range(start, end), req.token_ids(start, end), strict=True):
            block = req.block_ids[pos // BS]
            # a block shared through the prefix cache is full and complete: nobody writes to it
            assert self.pool.ref_counts[block] == 1, f"write into shared block {block}"
            self.slots[(block, pos % BS)] = tok

    def _check_context(self, req: Request, end: int) -> None:
        got = [self.slots.get((req.block_ids[p // BS], p % BS)) for p in range(end)]
        assert got == req.token_ids(0, end), f"{req.request_id} reads a wrong KV context"

    def check_pool(self) -> None:
        pool = self.pool
        holders = [0] * pool.num_blocks
        for req in self.live.values():
            assert len(set(req.block_ids)) == len(req.block_ids)
            for b in req.block_ids:
                holders[b] += 1
        assert holders == pool.ref_counts
        assert set(pool._free) == {b for b in range(pool.num_blocks) if pool.ref_counts[b] == 0}
        for b, n in enumerate(holders):
            if n > 1:
                assert pool.block_hash[b] is not None, "only cached (full) blocks may be shared"

    def assert_empty(self) -> None:
        assert not self.sched.has_work() and not self.live
        assert self.pool.num_free == self.pool.num_blocks
        assert all(r == 0 for r in self.pool.ref_counts)


def _fake_token(req: Request) -> int:
    return 1000 + (hash((req.request_id, req.num_tokens)) % 1000)


def _chunks(out: SchedulerOutput) -> list[tuple[str, int, int]]:
    return [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks]


# ---- tests ----------------------------------------------------------------------------------------


def test_long_prompt_is_chunked_within_the_budget():
    sim = Sim(num_blocks=32, budget=16)
    req = sim.add(list(range(1, 51)), max_tokens=3, rid="long")
    steps, sampled = [], []
    for _ in range(4):
        steps.append(_chunks(sim.step()))
        sampled += sim.sampled
    assert steps == [
        [("long", 0, 16)],
        [("long", 16, 16)],
        [("long", 32, 16)],
        [("long", 48, 2)],
    ]
    assert sampled == [False, False, False, True]
    assert len(req.output_token_ids) == 1
    assert _chunks(sim.step()) == [("long", 50, 1)]  # then one decode token per step
    sim.drain()
    assert req.output_token_ids and len(req.output_token_ids) == 3
    sim.assert_empty()


def test_decode_and_prefill_share_a_batch():
    sim = Sim(num_blocks=32, budget=16)
    sim.add([1, 2, 3, 4, 5], max_tokens=10, rid="a")
    assert _chunks(sim.step()) == [("a", 0, 5)]
    sim.add(list(range(100, 130)), max_tokens=2, rid="b")
    # a's decode comes first (running requests, oldest first), b's prefill fills the rest of the budget
    assert _chunks(sim.step()) == [("a", 5, 1), ("b", 0, 15)]
    assert _chunks(sim.step()) == [("a", 6, 1), ("b", 15, 15)]
    out = sim.step()
    assert _chunks(out) == [("a", 7, 1), ("b", 30, 1)]  # b sampled its first token last step
    sim.drain()
    sim.assert_empty()


def test_budget_is_shared_oldest_first_and_admission_stops_at_budget():
    sim = Sim(num_blocks=64, budget=16)
    for i in range(3):
        sim.add(list(range(10 * i + 1, 10 * i + 11)), max_tokens=2, rid=f"p{i}")
    out = sim.step()
    assert _chunks(out) == [("p0", 0, 10), ("p1", 0, 6)]
    assert [r.request_id for r in sim.sched.waiting] == ["p2"]
    assert _chunks(sim.step()) == [("p0", 10, 1), ("p1", 6, 4), ("p2", 0, 10)]
    sim.drain()
    sim.assert_empty()


def test_max_num_seqs_is_respected():
    sim = Sim(num_blocks=64, max_num_seqs=2, budget=64)
    for i in range(5):
        sim.add([i + 1] * 3, max_tokens=4)
    out = sim.step()
    assert len(out.chunks) == 2 and len(sim.sched.running) == 2 and len(sim.sched.waiting) == 3
    while sim.sched.has_work():
        sim.step()
        assert len(sim.sched.running) <= 2
    assert len(sim.finished) == 5
    sim.assert_empty()


def test_preempts_the_newest_running_request_and_recomputes_it():
    # 6 blocks of 4: two requests of 8-token prompts take 2 blocks each, then grow during decode
    sim = Sim(num_blocks=6, budget=64)
    old = sim.add(list(range(1, 9)), max_tokens=12, rid="old")
    new = sim.add(list(range(21, 29)), max_tokens=12, rid="new")
    sim.step()
    assert sim.sched.running == [old, new]
    preempted = None
    for _ in range(20):
        out = sim.step()
        if out.preempted:
            preempted = out
            break
    assert preempted is not None, "the pool should have run out"
    assert preempted.preempted == [new]
    assert sim.sched.num_preemptions == 1 and new.num_preemptions == 1
    assert _chunks(preempted) == [("old", old.num_computed_tokens - 1, 1)]  # old kept decoding
    assert sim.sched.running == [old] and list(sim.sched.waiting) == [new]
    assert new.status is Status.WAITING and new.block_ids == [] and new.num_computed_tokens == 0
    generated = list(new.output_token_ids)
    assert generated  # it had produced tokens: they are kept and recomputed, not regenerated

    sim.drain()
    assert old.finished and new.finished
    assert new.output_token_ids[: len(generated)] == generated
    assert len(new.output_token_ids) == 12
    sim.assert_empty()


def test_recompute_after_preemption_reuses_cached_blocks():
    sim = Sim(num_blocks=6, budget=64)
    old = sim.add(list(range(1, 9)), max_tokens=12, rid="old")
    new = sim.add(list(range(21, 29)), max_tokens=12, rid="new")
    while not sim.step().preempted:
        pass
    tokens_at_preemption = new.num_tokens
    # recompute starts once blocks are free; its cached full blocks (prompt and output) are reused
    while new.status is Status.WAITING:
        out = sim.step()
    ((chunk, sampled),) = [(c, s) for c, s in zip(out.chunks, sim.sampled, strict=True) if c.request is new]
    assert chunk.start > 0 and chunk.start % BS == 0  # prefix hits cover the leading full blocks
    assert chunk.start + chunk.num_tokens == tokens_at_preemption and sampled
    assert new.num_cached_tokens == 0  # counted at first admission only
    sim.drain()
    assert old.finished
    sim.assert_empty()


def test_preemption_without_prefix_caching_recomputes_everything():
    sim = Sim(num_blocks=6, budget=64, caching=False)
    sim.add(list(range(1, 9)), max_tokens=12, rid="old")
    new = sim.add(list(range(21, 29)), max_tokens=12, rid="new")
    while not sim.step().preempted:
        pass
    n = new.num_tokens
    while new.status is Status.WAITING:
        out = sim.step()
    assert [(c.start, c.num_tokens) for c in out.chunks if c.request is new] == [(0, n)]
    sim.drain()
    sim.assert_empty()


def test_prefix_hit_at_admission():
    sim = Sim(num_blocks=32, budget=64)
    prompt = list(range(1, 15))  # 14 tokens: 3 full blocks
    sim.add(prompt, max_tokens=2, rid="first")
    sim.drain()
    second = sim.add([*prompt, 99], max_tokens=2, rid="second")
    hits = sim.pool.hits
    assert _chunks(sim.step()) == [("second", 12, 3)]
    assert second.num_cached_tokens == 12 and sim.pool.hits == hits + 3
    sim.drain()
    sim.assert_empty()


def test_siblings_wait_for_the_leader_prefill():
    sim = Sim(num_blocks=32, budget=8)
    prompt = list(range(1, 15))
    leader = sim.add(prompt, max_tokens=3, rid="x#0")
    child = sim.add(prompt, max_tokens=3, rid="x#1", leader=leader)
    assert _chunks(sim.step()) == [("x#0", 0, 8)]  # the child is not admitted with budget left over
    assert child.status is Status.WAITING
    assert _chunks(sim.step()) == [("x#0", 8, 6)]
    out = sim.step()  # the leader's blocks are cached now: the child reuses all 3 full ones
    assert _chunks(out) == [("x#0", 14, 1), ("x#1", 12, 2)]
    assert child.block_ids[:3] == leader.block_ids[:3]
    sim.drain()
    sim.assert_empty()


def test_finish_of_waiting_and_running_requests_frees_blocks():
    sim = Sim(num_blocks=16, max_num_seqs=1, budget=64)
    a = sim.add(list(range(1, 10)), max_tokens=50)
    b = sim.add(list(range(20, 30)), max_tokens=50)
    sim.step()
    assert a.block_ids and b.status is Status.WAITING
    sim.abort(b)  # waiting
    sim.abort(a)  # running
    assert not sim.sched.has_work()
    sim.assert_empty()
    sim.sched.finish(a)  # finishing twice is harmless: the request holds nothing
    sim.assert_empty()


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_random_mix_returns_every_block(seed):
    rng = random.Random(seed)
    sim = Sim(num_blocks=20, max_num_seqs=5, budget=16)
    prefixes = [[rng.randrange(1, 500) for _ in range(rng.randrange(4, 13))] for _ in range(3)]
    aborted = 0
    for _ in range(200):
        if rng.random() < 0.35:
            head = rng.choice(prefixes) if rng.random() < 0.6 else []
            tail = [rng.randrange(1, 500) for _ in range(rng.randrange(1, 24))]
            prompt, max_tokens = (head + tail)[:36], rng.randrange(1, 13)  # <= 48 tokens = 12 blocks
            leader = sim.add(prompt, max_tokens)
            if rng.random() < 0.2:  # an n > 1 request: the sibling waits for the leader's prefill
                sim.add(prompt, max_tokens, leader=leader)
        if sim.live and rng.random() < 0.06:
            sim.abort(rng.choice(list(sim.live.values())))
            aborted += 1
        sim.step()
    sim.drain()
    sim.assert_empty()
    assert sim.sched.num_preemptions > 0 and aborted > 0 and sim.pool.hits > 0
    assert len(sim.finished) > 20
    assert all(len(r.output_token_ids) == r.max_tokens for r in sim.finished)
