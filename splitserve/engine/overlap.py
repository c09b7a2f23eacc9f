"""Overlapped decode steps (`async_scheduling`, on by default on CUDA): the pipeline of LLMEngine.step.

In steady decode the host would leave the GPU idle while it reads a step's tokens, checks stops and
prepares the next step. Instead a decode step's tokens stay on the device and each request gets a
placeholder token; the next `step()` schedules and launches step N+1 with those tokens fed to it on
the device, and only then reads step N's (waiting while N+1 runs), replaces the placeholders and checks
stop conditions. A request that stops at step N has computed one token too many in N+1, which is
dropped (its blocks are freed after N+1 in stream order).

Constrained requests (a grammar, engine/grammar.py) take part too: their next mask depends on step N's
token, so when a step has any, step N+1's forward is launched first, then step N's tokens are read and
advance the matchers, the bitmask of N+1 is filled on the host while N+1's forward runs, copied
(pinned, non-blocking), and only then is N+1's masked sampling enqueued. A request whose grammar
terminated at N drops its N+1 token as a stop does.

Only decode steps whose requests need nothing else from the host between steps overlap (no logprobs,
penalties, min_tokens, n > 1, KV export, recurrent state); new requests that can be admitted (some
wait and the batch has room), a request about to reach its length limit or a short block pool end the
overlap: the pending step is read first, and the next step runs as usual.

`OverlappedSteps` is owned by the engine (LLMEngine picks `_overlapped_step` as its step function when
async scheduling is on) and holds the pending step; `launch` and `read` take its tokens through the
scheduler (`advance` at launch, `take_tokens` once read), as `update_from_output` does for a plain step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from splitserve.engine.request import Request, RequestOutput
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.table import RequestTable

PLACEHOLDER = -1  # an output token of an overlapped step that is still on the device


def _pending(req: Request) -> bool:
    """`req`'s last output token is a placeholder: its overlapped step has not been read."""
    return bool(req.output_token_ids) and req.output_token_ids[-1] == PLACEHOLDER


@dataclass
class _Inflight:
    """An overlapped step: its scheduled chunks, the requests it samples for, their tokens on the
    device, and a copy of them on its way to the host."""

    sched: SchedulerOutput
    reqs: list[Request]
    tokens: torch.Tensor  # [N] int64 on the device
    host: torch.Tensor  # [N] int64 (pinned on CUDA)
    copied: torch.cuda.Event | None

    @classmethod
    def launch(cls, sched: SchedulerOutput, reqs: list[Request], tokens: torch.Tensor) -> _Inflight:
        if tokens.device.type != "cuda":
            return cls(sched, reqs, tokens, tokens, None)
        host = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True)
        with torch.cuda.device(tokens.device):  # the copy and its event on the tokens' GPU's stream
            host.copy_(tokens, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        return cls(sched, reqs, tokens, host, copied)

    def read(self) -> list[int]:
        if self.copied is not None:
            self.copied.synchronize()
        return self.host.tolist()


class OverlappedSteps:
    """The overlapped-step pipeline: the step launched and not read yet (`pending`), and when to go on
    overlapping. `enabled` off: no new overlap starts (a pending step is still read)."""

    def __init__(self, scheduler: Scheduler, runner: Any, sampler: Sampler, table: RequestTable,
                 max_model_len: int, enabled: bool, stateful: bool) -> None:  # fmt: skip
        self.scheduler, self.sampler, self.table = scheduler, sampler, table
        self.runner = runner  # runner.ModelRunner (not imported: runner -> isolate -> engine)
        self.max_model_len = max_model_len
        self.enabled = enabled
        self.stateful = stateful  # the model keeps recurrent state per request: its steps never overlap
        self.pending: _Inflight | None = None  # an overlapped step whose tokens are not read yet
        self.steps = 0  # steps launched overlapped

    def may_start(self, sched: SchedulerOutput) -> bool:
        """Start overlapping with this step: decode only, every request overlappable, no newcomer
        that the next step could admit."""
        if not self.enabled or self.stateful or self._admits():
            return False
        return all(c.num_tokens == 1 and c.samples and _overlappable(c.request) for c in sched.chunks)

    def may_continue(self) -> bool:
        """Launch the next step before reading the pending one: no waiting request can be admitted,
        no running request ends with its pending token by length, and the pool has a block for each
        running request."""
        running = self.scheduler.running
        if self._admits() or not running or self.scheduler.block_manager.pool.num_free < len(running):
            return False
        for req in running:
            if not _overlappable(req) or not _pending(req):
                return False  # not in the pending step (it joined otherwise)
            if len(req.output_token_ids) >= req.max_tokens or req.num_tokens >= self.max_model_len:
                return False
        return True

    def _admits(self) -> bool:
        """The next schedule may admit a waiting request (which would make it a prefill step): some
        wait and a running slot is free. A full batch with a queue keeps overlapping."""
        sched = self.scheduler
        return bool(sched.waiting) and len(sched.running) < sched.max_num_seqs

    def launch(self, sched: SchedulerOutput) -> list[RequestOutput]:
        """Launch `sched` with the pending step's tokens fed on the device, read the pending step while
        it runs, and leave this one pending. -> the pending step's outputs."""
        inflight, self.pending = self.pending, None  # a step that raises leaves no stale pending step
        feed = (
            None if inflight is None else (inflight.tokens, {id(r): i for i, r in enumerate(inflight.reqs)})
        )
        try:
            logits, sample_chunks = self.runner.execute(sched.chunks, feed)
        except BaseException:
            if inflight is not None:
                _unwind(inflight)
            raise
        reqs = [c.request for c in sample_chunks]
        outputs: list[RequestOutput] = []
        if inflight is not None and any(r.grammar is not None and r.grammar.needs_tokens for r in reqs):
            # the masks of this step need the pending step's tokens in the matchers: read it first (while
            # this step's forward runs), then fill the masks, then enqueue the masked sampling
            outputs, inflight = self._read(inflight), None
        try:
            pending = _Inflight.launch(sched, reqs, self.sampler.sample_tokens(logits, reqs))
        except BaseException:
            if inflight is not None:
                _unwind(inflight)
            for out in outputs:  # read already: the next step reports them
                self.table.due.post(out)
            raise
        self.steps += 1
        if inflight is not None:
            outputs = self._read(inflight)  # while this step runs
        self.scheduler.advance(sched)
        for req in reqs:
            if not req.finished:
                req.output_token_ids.append(PLACEHOLDER)
        self.pending = pending
        return outputs

    def read(self) -> list[RequestOutput]:
        """Read the pending step now (waiting for it); the next step runs as usual. -> its outputs."""
        inflight, self.pending = self.pending, None
        return [] if inflight is None else self._read(inflight)

    def _read(self, inflight: _Inflight) -> list[RequestOutput]:
        """Read an overlapped step's tokens (waiting for it), put them in place of the placeholders and
        take them (its chunks were counted at launch). A request that finished meanwhile (stopped one
        step earlier, or aborted) drops its token."""
        reqs, tokens = [], []
        for req, token in zip(inflight.reqs, inflight.read(), strict=True):
            if req.finished or not _pending(req):
                continue
            req.output_token_ids.pop()
            reqs.append(req)
            tokens.append(token)
        taken = self.scheduler.take_tokens(inflight.sched, reqs, tokens, [None] * len(reqs))
        return self.table.outputs(taken)


def _overlappable(req: Request) -> bool:
    """Nothing of `req` needs the host between two of its decode steps (a grammar's mask is filled while
    the next step's forward runs)."""
    p = req.params
    return (
        req.parent_id is None
        and not req.export_kv
        and p.logprobs is None
        and p.min_tokens == 0
        and not p.has_penalties
        and req.state_slot is None
    )


def _unwind(inflight: _Inflight) -> None:
    """The step after `inflight` failed before `inflight` was read: forget its tokens (placeholders out,
    their positions uncomputed again), so that the requests recompute them in a later step."""
    for req in inflight.reqs:
        if not req.finished and _pending(req):
            req.output_token_ids.pop()
            req.num_computed_tokens -= 1


__all__ = ["PLACEHOLDER", "OverlappedSteps"]
