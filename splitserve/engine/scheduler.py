"""Continuous batching in the vLLM v1 manner: no prefill or decode phases, only a token budget.

Each step, running requests (oldest first) get the tokens they still lack (one for a decoding
request, up to the whole remaining budget for a prefilling one), then waiting requests are admitted
while budget, `max_num_seqs` and blocks last. A long prompt is thereby chunked across steps, and
prefill chunks share a batch with decode tokens. When a running request needs a block and none is
free, the newest running request is preempted (blocks freed, recomputed later).

A request whose prompt KV comes from another engine (KV transfer, decode side) waits apart, in
`waiting_for_kv` (Status.WAITING_FOR_KV): `poll_kv()`, each step and without blocking, reserves its
prompt's blocks and state slot once they are free; the engine then has the connector load them, and
`kv_loaded()` queues it at the front of `waiting` with its prompt computed (or not: recompute).

After the model ran a step and its tokens were sampled, `update_from_output` is the rest of the step:
computed tokens counted, each token appended with its stop checks (a request that stops is freed; one
that exports its KV leaves through `on_export`), full blocks offered to the prefix cache.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request, Status
from splitserve.engine.stop import take_token
from splitserve.sampling.logprobs import TokenLogprob


@dataclass(frozen=True)
class ScheduledChunk:
    request: Request
    start: int  # first token position computed in this step
    num_tokens: int  # the request's own tokens, then its drafts
    drafts: tuple[int, ...] = ()  # speculative decoding: draft tokens verified after the known ones

    @property
    def samples(self) -> bool:
        """True when this chunk reaches the end of the request's known tokens, so a token is sampled
        (with drafts: one at each draft's position too)."""
        return self.start + self.num_tokens - len(self.drafts) == self.request.num_tokens


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: list[ScheduledChunk]
    preempted: list[Request]

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self, block_manager: BlockManager, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int
    ) -> None:
        self.block_manager = block_manager
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        # prefill side of a KV transfer: takes a request with `export_kv` out after its first token
        # (the engine's KVTransfers.export, which asks the connector to lease the prompt's blocks)
        self.on_export: Callable[[Request], None] | None = None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.waiting_for_kv: list[Request] = []  # their prompt's KV is on its way (kv_wait set)
        self.num_preemptions = 0
        # prompt tokens looked up in the prefix cache at first admission, and those it served (vLLM's
        # prefix_cache_queries / prefix_cache_hits)
        self.prefix_queries = 0
        self.prefix_hits = 0
        # prompt tokens this engine computed (prefix-cache hits and imported KV excluded): a prefill
        # worker's share of the split, and, on a decode worker, prompts it prefilled itself
        self.prompt_tokens_computed = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    # ---- KV transfer (decode side) ---------------------------------------------------------------

    def wait_for_kv(self, req: Request) -> None:
        """Hold `req` (its `kv_wait` set) until its prompt's KV has been loaded or given up on."""
        assert req.kv_wait is not None
        req.status = Status.WAITING_FOR_KV
        self.waiting_for_kv.append(req)

    def poll_kv(self) -> tuple[list[Request], list[Request]]:
        """Without blocking: reserve the prompt's blocks (and state slot) of each request waiting for
        its KV that has none yet, all or nothing. -> (ready to load: reserved now, or needing no room;
        out of room: none by its `room_by`). Both are marked `loading` (polled no more); they stay
        in `waiting_for_kv` until `kv_loaded` or `finish`."""
        ready: list[Request] = []
        late: list[Request] = []
        now = time.monotonic()
        for req in self.waiting_for_kv:
            wait = req.kv_wait
            assert wait is not None
            if wait.loading:
                continue
            if not wait.needs_room or self.block_manager.allocate(req, req.num_prompt_tokens):
                ready.append(req)
            elif now >= wait.room_by:
                late.append(req)
            else:
                continue
            wait.loading = True
        return ready, late

    def kv_loaded(self, req: Request, num_computed_tokens: int) -> None:
        """`req`'s wait ended: queue it first (it has waited already) with `num_computed_tokens` of
        its prompt computed (the KV loaded: all of it; a recompute: 0, its blocks freed first)."""
        if req in self.waiting_for_kv:
            self.waiting_for_kv.remove(req)
        req.kv_wait = None
        req.num_computed_tokens = num_computed_tokens
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # ---- the step --------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            n = self.block_manager.chunk_tokens(req, req.num_computed_tokens, n)
            drafts = self._drafts(req, n, budget)
            if not drafts and not self._allocate_or_preempt(req, n, preempted):
                break  # `req` itself was preempted: everything after it already was
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n + len(drafts), drafts))
            budget -= n + len(drafts)
            i += 1
        if not preempted:
            budget = self._admit(chunks, budget)
        return SchedulerOutput(chunks, preempted)

    def _drafts(self, req: Request, n: int, budget: int) -> tuple[int, ...]:
        """Speculative decoding: the request's draft tokens (taken: a draft is verified once) that fit
        after its `n` scheduled tokens, where those reach its end, in the budget and in free blocks
        (allocated here); () for none."""
        drafts, req.draft_token_ids = req.draft_token_ids[: budget - n], []
        if not drafts or req.num_computed_tokens + n != req.num_tokens:
            return ()
        return tuple(drafts) if self.block_manager.allocate(req, n + len(drafts)) else ()

    def _allocate_or_preempt(self, req: Request, n: int, preempted: list[Request]) -> bool:
        while not self.block_manager.allocate(req, n):
            victim = self.running.pop()
            self._preempt(victim)
            preempted.append(victim)
            if victim is req:
                return False
        return True

    def _admit(self, chunks: list[ScheduledChunk], budget: int) -> int:
        skipped: list[Request] = []
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting.popleft()
            if _waits_for_leader(req):
                skipped.append(req)
                continue
            prefix = self.block_manager.find_prefix(req) if req.num_computed_tokens == 0 else []
            cached = len(prefix) * self.block_manager.block_size
            n = min(req.num_tokens - req.num_computed_tokens - cached, budget)
            n = self.block_manager.chunk_tokens(req, req.num_computed_tokens + cached, n)
            drafts = self._drafts(req, n, budget) if req.num_computed_tokens else ()  # a KV import's
            if not drafts and not self.block_manager.allocate(req, n, prefix):
                self.waiting.appendleft(req)
                break
            if req.num_preemptions == 0:
                req.num_cached_tokens = cached
                if self.block_manager.pool.enable_prefix_caching and req.num_computed_tokens == 0:
                    self.prefix_queries += req.num_tokens
                    self.prefix_hits += cached
            req.num_computed_tokens += cached
            req.status = Status.RUNNING
            if req.scheduled_time is None:
                req.scheduled_time = time.monotonic()
            self.running.append(req)
            chunks.append(ScheduledChunk(req, req.num_computed_tokens, n + len(drafts), drafts))
            budget -= n + len(drafts)
        self.waiting.extendleft(reversed(skipped))
        return budget

    def _preempt(self, req: Request) -> None:
        self.num_preemptions += 1
        self.block_manager.free(req)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        req.status = Status.WAITING
        self.waiting.appendleft(req)

    # ---- after the step ran ---------------------------------------------------------------------

    def update_from_output(
        self,
        out: SchedulerOutput,
        reqs: list[Request],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
    ) -> list[Request]:
        """After the model ran `out` and sampled `tokens` for `reqs`: the chunks' tokens are computed,
        then the tokens taken (`take_tokens`). -> the requests that took a token."""
        self.advance(out)
        return self.take_tokens(out, reqs, tokens, logprobs)

    def take_tokens(
        self,
        out: SchedulerOutput,
        reqs: list[Request],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
    ) -> list[Request]:
        """Append each sampled token (stop checks, KV export), then offer the blocks `out` filled to the
        prefix cache. -> `reqs`. (An overlapped step counts its chunks at launch and takes its tokens
        one step later.)"""
        now = time.monotonic()
        for req, token, lp in zip(reqs, tokens, logprobs, strict=True):
            req.first_token_time = req.first_token_time or now
            self.append_token(req, token, lp)
        self.cache_filled_blocks(out)
        return reqs

    def append_token(self, req: Request, token: int, lp: TokenLogprob | None) -> None:
        """One token of `req`: a request that stops is finished (full blocks cached, the rest freed); one
        that exports its KV leaves the batch with its prompt's blocks through `on_export`."""
        if take_token(req, token, lp, self.max_model_len) is not None:
            req.status = Status.FINISHED
            self.block_manager.cache_full_blocks(req)
            self.finish(req)
        elif req.export_kv:
            assert self.on_export is not None, "a request exports its KV, but no KV transfer is attached"
            self.on_export(req)

    def advance(self, out: SchedulerOutput) -> None:
        """After the model ran `out`: each scheduled chunk's tokens are computed."""
        for chunk in out.chunks:
            req = chunk.request
            if chunk.start < req.num_prompt_tokens:
                self.prompt_tokens_computed += min(chunk.num_tokens, req.num_prompt_tokens - chunk.start)
            req.num_computed_tokens += chunk.num_tokens

    def cache_filled_blocks(self, out: SchedulerOutput) -> None:
        """After the step's tokens were taken: offer the blocks `out` filled to the prefix cache (a
        request that finished did already, as it finished)."""
        for chunk in out.chunks:
            if not chunk.request.finished:
                self.block_manager.cache_full_blocks(chunk.request)

    @contextmanager
    def only(self, keep: set[int]) -> Iterator[None]:
        """Inside: schedule only the requests whose id() is in `keep`; the others stay where they are,
        blocks and all, untouched (to find which request a failing step is pinned on). On exit the
        held requests are back in their places; anything `keep` admitted or preempted meanwhile stays
        where the schedule put it."""
        running, waiting = self.running, self.waiting
        self.running = [r for r in running if id(r) in keep]
        self.waiting = deque(r for r in waiting if id(r) in keep)
        try:
            yield
        finally:
            now_running, now_waiting = set(map(id, self.running)), set(map(id, self.waiting))
            was_running, was_waiting = set(map(id, running)), set(map(id, waiting))
            self.running = [r for r in running if id(r) not in keep or id(r) in now_running] + [
                r for r in self.running if id(r) not in was_running
            ]
            preempted = [r for r in self.waiting if id(r) not in was_waiting]
            self.waiting = deque(
                preempted + [r for r in waiting if id(r) not in keep or id(r) in now_waiting]
            )

    def finish(self, req: Request, after: Any = None) -> None:
        """Remove a finished or aborted request from whichever queue holds it and free its blocks
        (once `after`, a CUDA event, has happened: a late copy may still write them)."""
        self.detach(req)
        self.block_manager.free(req, after=after)

    def detach(self, req: Request) -> None:
        """Remove a request from whichever queue holds it, keeping its blocks (a KV export holds them)."""
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req in self.waiting_for_kv:
            self.waiting_for_kv.remove(req)
            req.kv_wait = None


def _waits_for_leader(req: Request) -> bool:
    leader = req.leader
    return (
        leader is not None and not leader.finished and leader.num_computed_tokens < leader.num_prompt_tokens
    )
