"""The engine's side of speculative decoding: drafting, the verify step, rollback and counters.

A step with drafts, for a request whose known tokens end at position p0 (its last token, not yet
computed) and drafts d1..dk:

  1. `propose` (before the schedule): each eligible running request, and each waiting one whose KV
     was imported (so a decode engine verifies from a request's first step), gets up to k drafts
     (`Request.draft_token_ids`: n-gram lookup, or those the MTP head made after the last step,
     mtp.py); the scheduler appends those that fit to its chunk, which then
     computes positions ..p0 and p0+1..p0+k, with a logits row at p0 and at each draft.
  2. The step runs (hybrid models: each drafted request's recurrent and conv state copied first).
  3. `accept.py` turns the rows into the tokens produced (with the MTP drafter, its head then catches
     up over the step's positions, mtp.py): the accepted drafts d1..dm, then one more
     (the target's correction, or the bonus token when m = k). They are appended one by one with the
     usual stop checks (a stop or max_tokens inside the run ends it there); before the j-th token,
     positions up to p0 + j - 1 count as computed, as after a plain decode step.
  4. Rollback: computed tokens end at the last accepted one (p0 + m); KV written for rejected drafts
     lies past that and is overwritten when those positions are computed again. Blocks past the
     request's known tokens are returned. A hybrid model's state has consumed every draft: when
     some were rejected it is restored from the copy and the chunk's tokens count as uncomputed
     again, so the next step recomputes them (with the new token, and drafts of its own).
  5. The MTP drafter makes the next step's drafts from the head's state at the new end.

Which requests draft: greedy or sampled ones without logprobs, penalties, a grammar, a pending
min_tokens or a KV export. Back-off: (a) no request drafts while `disable_by_batch_size` or more run
(a large batch is compute-bound: verifying k more rows a request costs more than the steps it
saves); (b) a request whose last verify steps accepted nothing pauses drafting for 2, 4, 8, ... up to
32 steps, so text with nothing to quote costs no verify rows after a few misses.

The MTP head's back-off: while (a) holds the head's catch-up (step 3) is pure cost (a few per cent of
a step at Qwen3.5-9B's shape, docs/performance.md). It goes on for `HEAD_GRACE_STEPS` steps after (a)
begins (so a batch that hovers around the cap keeps its requests' head context), then stops: the
step runs as a plain one, with neither the head's runs nor its CUDA graphs, and each request of it
that misses a position there loses its head context (`Request.head_lost`, counted in
`SpecStats.num_head_lost`): it never drafts with MTP again, since its drafts would attend to head K/V
that was never written (still exact, being verified, but accepted at random). Requests prefilled
after (a) ends have a whole head context and draft as usual. A KV export's prompt is caught up
whatever the batch: its head K/V and state are for the decode engine, which drafts by its own batch
(spec/mtp.py).

The blocks such a request fills from then on hold no head K/V: they enter the prefix cache marked so
(`BlockPool.headless`), and a later request that would reuse them either stops its hit before them
(it needs the head's context: it may draft, or it is a KV export) or takes them and loses its head
context too (block_manager.py). Blocks filled before the loss keep theirs: they are offered to the
cache as they stand first (a KV import's prompt, whose head K/V came with it, included).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from splitserve.config.speculative import SpeculativeConfig, speculative_config
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.engine.sampler import Sampler, target_probs
from splitserve.engine.scheduler import ScheduledChunk, Scheduler, SchedulerOutput
from splitserve.engine.spec.accept import accept_greedy, accept_sampled
from splitserve.engine.spec.mtp import MTPDrafter
from splitserve.engine.spec.ngram import NgramDrafter

MAX_PAUSE = 32  # steps a request that keeps missing waits before drafting again, at most
HEAD_GRACE_STEPS = 16  # steps the MTP head goes on catching up once `disable_by_batch_size` holds


@dataclass
class SpecCounters:
    """vLLM's spec_decode counters: verify runs, draft tokens, accepted drafts (and by position)."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)
    num_first_step_drafts: int = 0  # verify runs at a request's first decode step (after its prompt)
    num_head_lost: int = 0  # requests that lost the MTP head's context (its back-off, module docstring)

    def count(self, drafted: int, accepted: int, first_step: bool = False) -> None:
        self.num_drafts += 1
        self.num_first_step_drafts += first_step
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        if len(self.accepted_per_pos) < drafted:
            self.accepted_per_pos += [0] * (drafted - len(self.accepted_per_pos))
        for i in range(accepted):
            self.accepted_per_pos[i] += 1


@dataclass(frozen=True)
class SpecStats:
    """A snapshot of the counters (`EngineStats.spec_decode`)."""

    method: str
    num_drafts: int
    num_draft_tokens: int
    num_accepted_tokens: int
    accepted_per_pos: tuple[int, ...]
    num_first_step_drafts: int = 0  # verify runs at a request's first decode step (local or imported KV)
    num_head_lost: int = 0  # requests that lost the MTP head's context and draft no more

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens a verify run produced on average: its accepted drafts plus the one it always adds."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecoder:
    def __init__(
        self, config: SpeculativeConfig, states: dict[str, torch.Tensor], mtp: MTPDrafter | None = None
    ) -> None:
        self.config = config
        self.k = config.num_speculative_tokens
        self.drafter = NgramDrafter(*config.ngram_range)
        self.mtp = mtp  # method "mtp": the head's drafts instead of the n-gram lookup's
        self.states = states  # hybrid models' state pools ({} for others)
        self.counters = SpecCounters()
        self.max_model_len = 0  # set by `propose`
        self.head_grace = HEAD_GRACE_STEPS  # the MTP head's back-off (module docstring)
        self.capped_steps = 0  # steps in a row that began with `disable_by_batch_size` holding
        self.blocks: BlockManager | None = None  # MTP: the engine's, once `attach`ed

    def attach(self, blocks: BlockManager) -> None:
        """MTP: follow which cached blocks hold the head's K/V in `blocks` (block_manager.py)."""
        if self.mtp is not None:
            self.blocks = blocks
            blocks.head = self

    @classmethod
    def create(
        cls,
        config: SpeculativeConfig | dict | str | None,
        states: dict[str, torch.Tensor],
        mtp: MTPDrafter | None = None,
    ) -> SpecDecoder | None:
        """The decoder `config` asks for (parsed as `speculative_config` does), or None when it is off."""
        parsed = speculative_config(config)
        return None if parsed is None else cls(parsed, states, mtp)

    @property
    def head_on(self) -> bool:
        """Whether the MTP head catches up on this step's requests: it is configured, and the batch is
        under the cap or has been over it for at most `head_grace` steps (set by `propose`)."""
        return self.mtp is not None and self.capped_steps <= self.head_grace

    def catches_up(self, sched: SchedulerOutput) -> bool:
        """Whether the MTP head catches up on the step `sched` (which then runs through `run`, drafts or
        not). With the head off only a KV export's chunks are caught up, and every other request of
        the step loses its head context here; requests that lost it are never caught up again."""
        if self.mtp is None:
            return False
        if not self.head_on:
            for c in sched.chunks:
                if not c.request.export_kv:
                    self.lose_head(c.request)
        return any(not c.request.head_lost for c in sched.chunks)

    def needs_head(self, req: Request) -> bool:
        """Whether `req` must find the head's K/V over a prefix it reuses: it exports its KV (the decode
        engine may draft from it), or it may draft here (the head is on, its context intact, and its
        parameters allow drafts)."""
        p = req.params
        return req.export_kv or (self.head_on and not req.head_lost and req.grammar is None
                                 and p.logprobs is None and not p.has_penalties)  # fmt: skip

    def lose_head(self, req: Request) -> None:
        """`req` loses the head's context (counted once). Its full blocks so far hold the head's K/V:
        they are offered to the prefix cache first, as such (a KV import's are otherwise cached only
        after its first step)."""
        if req.head_lost:
            return
        if self.blocks is not None:
            self.blocks.cache_full_blocks(req)
        req.head_lost = True
        self.counters.num_head_lost += 1

    def stats(self) -> SpecStats:
        c = self.counters
        return SpecStats(self.config.method, c.num_drafts, c.num_draft_tokens, c.num_accepted_tokens,
                         tuple(c.accepted_per_pos), c.num_first_step_drafts, c.num_head_lost)  # fmt: skip

    # ---- drafting ---------------------------------------------------------------------------------

    def propose(self, scheduler: Scheduler, max_model_len: int, runner: Any = None) -> None:
        """Set the drafts of each running request that drafts this step, and of each waiting one whose
        KV was imported (its first step then verifies drafts too; see the module docstring)."""
        self.max_model_len = max_model_len
        capped = self._capped(scheduler)
        self.capped_steps = self.capped_steps + 1 if capped else 0
        imported = [r for r in scheduler.waiting if _kv_imported(r)]
        if self.mtp is not None and imported and not capped:
            self.mtp.resume(runner, scheduler.block_manager, self._budget_now, imported)
        for req in [*scheduler.running, *imported]:
            req.draft_token_ids = []  # none left from a step that did not schedule it
            if capped:
                continue
            if req.draft_pause > 0:
                req.draft_pause -= 1
                continue
            k = self._budget(req)
            if k > 0 and req.num_tokens - req.num_computed_tokens <= 1 + self.k:
                if self.mtp is not None:
                    req.draft_token_ids = self.mtp.take(req)[:k]
                else:
                    tokens = np.asarray(req.prompt_token_ids + req.output_token_ids, dtype=np.int64)
                    req.draft_token_ids = self.drafter.propose(tokens, k)

    def _capped(self, scheduler: Scheduler) -> bool:
        cap = self.config.disable_by_batch_size
        return cap is not None and len(scheduler.running) >= cap

    def _budget(self, req: Request) -> int:
        """How many drafts `req` may verify in its next step (0: none)."""
        if not _drafts_allowed(req) or (self.mtp is not None and req.head_lost):
            return 0
        return max(0, min(self.k, req.max_tokens - len(req.output_token_ids) - 1,
                          self.max_model_len - req.num_tokens))  # fmt: skip

    # ---- the verify step --------------------------------------------------------------------------

    def run(
        self, sched: SchedulerOutput, runner: Any, sampler: Sampler, scheduler: Scheduler
    ) -> list[Request]:
        """Run a step in which some chunks carry drafts on `runner` (runner.ModelRunner), take its tokens
        into `scheduler`; -> the requests that took a token."""
        saved = self._save_states(sched)
        logits, sample_chunks = runner.execute(sched.chunks)
        plain: list[Request] = []
        plain_rows: list[int] = []
        verified: list[tuple[ScheduledChunk, torch.Tensor]] = []
        row = 0
        for c in sample_chunks:
            if c.drafts:
                verified.append((c, logits[row : row + 1 + len(c.drafts)]))
            else:
                plain.append(c.request)
                plain_rows.append(row)
            row += 1 + len(c.drafts)
        tokens, logprobs = sampler(logits[plain_rows], plain) if plain else ([], [])
        runs = [(c, self._accept(c, rows, sampler)) for c, rows in verified]
        if self.mtp is not None:  # before any token is appended: a KV export leaves with its blocks
            produced = {id(r): [t] for r, t in zip(plain, tokens, strict=True)}
            produced.update((id(c.request), p) for c, p in runs)
            self.mtp.catch_up(runner, sched.chunks, produced)
        scheduler.advance(SchedulerOutput([c for c in sched.chunks if not c.drafts], []))
        now = time.monotonic()
        for req, token, lp in zip(plain, tokens, logprobs, strict=True):
            req.first_token_time = req.first_token_time or now
            scheduler.append_token(req, token, lp)
        for c, produced_run in runs:
            self._take_run(c, produced_run, saved.get(id(c.request)), scheduler)
        scheduler.cache_filled_blocks(sched)
        took = plain + [c.request for c, _ in verified]
        if self.mtp is not None and not self._capped(scheduler):
            self.mtp.draft(runner, scheduler.block_manager, self._budget_now, took)
        return took

    def _budget_now(self, req: Request) -> int:
        """MTP: the drafts `req` may take next step, if it is not pausing (its pause runs in `propose`)."""
        return 0 if req.draft_pause > 0 else self._budget(req)

    def _accept(self, c: ScheduledChunk, rows: torch.Tensor, sampler: Sampler) -> list[int]:
        """`c`'s drafts against its logits `rows` [1 + k, V]: the tokens its run produces (counted)."""
        req = c.request
        if req.params.greedy:
            produced = accept_greedy(rows[:, : sampler.vocab_size], c.drafts)
        else:
            probs = target_probs(rows[:, : sampler.vocab_size], [req] * len(rows))
            gen = req.generator if req.generator is not None else sampler.generator
            produced = accept_sampled(probs, c.drafts, gen)
        first = c.start == req.num_prompt_tokens and len(req.output_token_ids) == 1
        self.counters.count(len(c.drafts), len(produced) - 1, first)
        _back_off(req, len(produced) - 1)
        return produced

    def _take_run(self, c: ScheduledChunk, produced: list[int], saved: dict[str, torch.Tensor] | None,
                  scheduler: Scheduler) -> None:  # fmt: skip
        """Append the tokens of `c`'s run, then roll back what rejected drafts left."""
        req = c.request
        accepted = len(produced) - 1
        last = c.start + c.num_tokens - len(c.drafts) - 1  # p0: the last known token's position
        for j, token in enumerate(produced, 1):
            req.num_computed_tokens = last + j
            scheduler.append_token(req, token, None)
            if req.finished:
                return  # its blocks and state are freed
        if saved is not None and accepted < len(c.drafts):
            slot = req.state_slot
            for name, t in self.states.items():
                t[slot].copy_(saved[name], non_blocking=True)
            req.num_computed_tokens = c.start  # the state is as before the chunk: compute it again
        scheduler.block_manager.trim(req)

    def _save_states(self, sched: SchedulerOutput) -> dict[int, dict[str, torch.Tensor]]:
        """Hybrid models: a copy of each drafted request's state slot, by id(request)."""
        if not self.states:
            return {}
        saved: dict[int, dict[str, torch.Tensor]] = {}
        for c in sched.chunks:
            if c.drafts:
                slot = c.request.state_slot
                saved[id(c.request)] = {name: t[slot].clone() for name, t in self.states.items()}
        return saved


def _drafts_allowed(req: Request) -> bool:
    """Whether `req`'s tokens may come from a verify run: nothing of it depends on each token in turn
    beyond what the acceptance rules and the stop checks handle."""
    p = req.params
    return (
        not req.export_kv
        and req.grammar is None
        and p.logprobs is None
        and not p.has_penalties
        and len(req.output_token_ids) >= p.min_tokens
        and bool(req.output_token_ids)
    )


def _kv_imported(req: Request) -> bool:
    """Whether waiting `req` came with its prompt's KV from another engine and has only its first
    token, appended there, left to compute (a local request waits with nothing computed)."""
    return req.num_computed_tokens > 0 and req.num_tokens - req.num_computed_tokens == 1


def _back_off(req: Request, accepted: int) -> None:
    """After a verify run: a request that accepted nothing `n` runs in a row pauses 2^n steps."""
    if accepted:
        req.draft_misses = 0
        return
    req.draft_misses += 1
    req.draft_pause = min(2**req.draft_misses, MAX_PAUSE)


def has_drafts(sched: SchedulerOutput) -> bool:
    return any(c.drafts for c in sched.chunks)
