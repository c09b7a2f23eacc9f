"""MTP drafting: Qwen3.5's multi-token-prediction head (model/qwen3_5_mtp.py) proposes the drafts.

The head at position i reads the target's hidden state h_i and the token at i + 1, and guesses the
token at i + 2; its layer's K/V sit in the request's own blocks (extra KV layers after the target's).
Two parts per engine step, on the target's final hidden states of that step (the runner keeps them in
`last_hidden`, from an eager forward or from the decode and verify CUDA graphs' outputs). On CUDA the
head's runs replay graphs of their own where the step fits one (spec/mtp_graphs.py: the catch-up of a
decode or verify graph's step, and all k drafts of up to the verify graphs' widest batch in one
replay), else they run eagerly; either way the drafts stay on the device until all are made:

  1. `catch_up` (after the target ran and its tokens were decided, before they are appended): the head
     runs over every position of the step whose next token is now known and whose target state
     stands: a prompt chunk's positions (a middle chunk's last next token is the prompt's own; the
     last chunk's is the sampled token), a decode's one, a verify chunk's positions up to the last
     accepted draft. Its K/V there are what later drafts attend to, so they are written for every
     request, drafting or not, a KV export included (the prefill side hands them over with the
     prompt's KV). Positions past the last accepted draft are left for the next step to overwrite.
     The exception is the head's back-off (spec/verify.py): once the batch has been at the drafting
     cap for a few steps the engine runs plain steps, and a request that missed a position there
     (`Request.head_lost`) is skipped from then on, its rows in a catch-up graph running on token 0.
  2. `draft` (after the tokens were appended): for each request that drafts, with its last two known
     tokens at positions q and q + 1, the head's output at q gives the first draft (argmax: a point
     mass, as the acceptance rules take it); each further draft j runs the head once more at position
     q + j on its own previous output state and draft j - 1 (K/V written at q + j, in blocks allocated
     for it and trimmed after: the next step's catch-up writes those positions again from the target's
     states). Greedy drafts: the output distribution is the target's either way (accept.py).

Through the split: the prefill engine's catch-up over a prompt's last chunk writes the head's K/V at
every prompt position into the blocks that are exported, and the head's state at the last one into the
request's state slot (`STATE`), which the export carries with the recurrent state. The decode engine,
once the KV and state arrived, drafts from that state (`resume`) before the request's first step, so
that step already verifies drafts. The prefill engine catches up a KV export's prompt whatever its own
batch: whether the request drafts is decided by the decode engine's batch, which the prefill engine
does not know, and a head context missing there could not be made up (the head over a prompt costs
about one layer of the target's forward over it).

A prefix-cache hit reuses the head's K/V with the blocks; the K/V of a block's last position was made
with the token after it, so a request that shares the block but not that token drafts a little worse
there (drafts only: the target verifies every token). A block computed while the head was off holds
no head K/V: the prefix cache knows it (`BlockPool.headless`), and a request that drafts does not
reuse it (block_manager.py).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import nullcontext
from typing import Any, NamedTuple

import numpy as np
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.request import Request
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.engine.spec.rows import order_key
from splitserve.model.decoder import ForwardContext
from splitserve.model.qwen3_5_mtp import STATE


class MTPDrafter:
    def __init__(self, head: torch.nn.Module, target: torch.nn.Module) -> None:
        self.head = head  # Qwen3_5MTP
        self.target = target  # Qwen3_5LM
        self.vocab_size = target.cfg.vocab_size
        self._last: dict[int, tuple[torch.Tensor, int]] = {}  # id(req) -> (head's state at q, q)
        self.drafts: dict[int, tuple[int, list[int]]] = {}  # id(req) -> (its num_tokens, drafts)

    def take(self, req: Request) -> list[int]:
        """The drafts made for `req` after its last step, if its tokens have not moved since."""
        made = self.drafts.pop(id(req), None)
        return made[1] if made is not None and made[0] == req.num_tokens else []

    @torch.inference_mode()
    def catch_up(self, runner: Any, chunks: Sequence[ScheduledChunk], produced: dict[int, list[int]]) -> None:
        """Run the head over the positions of the step `chunks` (as `runner.execute` got them) whose
        next token is known; `produced`: id(request) -> the tokens this step gives it (not yet
        appended). Keeps the head's state at the last position of each request that got tokens."""
        hidden, runner.last_hidden = runner.last_hidden, None
        pieces = [p for p in _pieces(chunks, produced) if not p.sub.request.head_lost]
        self._last = {}
        if not pieces:
            return
        graphs = getattr(runner, "head_graphs", None)  # on CUDA: spec/mtp_graphs.py
        replayed = getattr(runner, "replayed", None)
        ends = graphs.catch_up(replayed, [(p.index, p.next_ids) for p in pieces]) if graphs else None
        if ends is None:
            assert hidden is not None, "the target ran no forward pass this step (or the runner kept none)"
            ends = self._catch_up_eager(runner, pieces, hidden)
        for p, end in zip(pieces, ends, strict=True):
            req = p.sub.request
            if id(req) in produced:
                self._last[id(req)] = (end, p.sub.start + p.sub.num_tokens - 1)
                if req.export_kv and req.state_slot is not None:  # leaves with the KV (module docstring)
                    runner.states[STATE][req.state_slot].copy_(end)

    def _catch_up_eager(self, runner: Any, pieces: list[_Piece], hidden: torch.Tensor) -> list[torch.Tensor]:
        """The head over `pieces` as one eager step on `hidden` (the target's rows in the runner's
        order); -> its output at each piece's last position, in `pieces`' order."""
        order = sorted(range(len(pieces)), key=lambda i: order_key(pieces[i].sub))
        rows = torch.tensor([r for i in order for r in pieces[i].rows], device=hidden.device)
        subs = [pieces[i].sub for i in order]
        out = self._run(runner, subs, [t for i in order for t in pieces[i].next_ids], hidden[rows], step=0)
        ends = np.cumsum([pieces[i].sub.num_tokens for i in order]) - 1
        by_piece: list[torch.Tensor] = [out] * len(pieces)
        for i, end in zip(order, ends, strict=True):
            by_piece[i] = out[int(end)]
        return by_piece

    @torch.inference_mode()
    def draft(self, runner: Any, blocks: BlockManager, budget: Callable[[Request], int],
              reqs: Sequence[Request]) -> None:  # fmt: skip
        """Drafts for each of `reqs` whose last position the step's catch-up reached (up to
        `budget(req)` of them; 0: none), kept for `take`."""
        self.drafts = {}
        self._make(runner, blocks, budget, reqs, self._last)

    @torch.inference_mode()
    def resume(self, runner: Any, blocks: BlockManager, budget: Callable[[Request], int],
               reqs: Sequence[Request]) -> None:  # fmt: skip
        """Drafts for `reqs`, whose KV and state were imported (prompt computed elsewhere, first token
        appended), from the head's state at the last prompt position that came in their state slot."""
        last = {id(r): (runner.states[STATE][r.state_slot], r.num_tokens - 2) for r in reqs
                if r.state_slot is not None}  # fmt: skip
        self._make(runner, blocks, budget, reqs, last)

    def _make(self, runner: Any, blocks: BlockManager, budget: Callable[[Request], int],
              reqs: Sequence[Request], lasts: dict[int, tuple[torch.Tensor, int]]) -> None:  # fmt: skip
        """Drafts for each of `reqs` from the head's state at its second-to-last known position
        (`lasts`: id(request) -> (state [H], position)), into `self.drafts`."""
        todo: list[tuple[Request, int]] = []  # (request, drafts it may take)
        states: list[torch.Tensor] = []
        for req in reqs:
            last = lasts.get(id(req))
            if last is None or req.finished or last[1] != req.num_tokens - 2:
                continue
            k = budget(req)
            if k > 1 and not blocks.allocate(req, req.num_tokens - 2 + k - req.num_computed_tokens):
                k = 1  # no room for the further steps' K/V: the first draft needs none
            if k > 0:
                todo.append((req, k))
                states.append(last[0])
        if not todo:
            return
        graphs = getattr(runner, "head_graphs", None)  # on CUDA: spec/mtp_graphs.py
        made = graphs.draft(todo, states) if graphs is not None else None
        if made is None:
            made = self._draft_eager(runner, todo, states)
        for (req, k), drafts in zip(todo, made, strict=True):
            if k > 1:
                blocks.trim(req)
            self.drafts[id(req)] = (req.num_tokens, drafts)

    def _draft_eager(self, runner: Any, todo: list[tuple[Request, int]], states: list[torch.Tensor]
                     ) -> list[list[int]]:  # fmt: skip
        """The drafts of `todo` from `states`, the head run eagerly; each draft stays on the device and
        feeds the next run, and all come to the host at the end."""
        guesses: list[tuple[list[int], torch.Tensor]] = []  # (entries of `todo`, their drafts) per step
        active = list(range(len(todo)))  # the entries of `todo` that `state`'s rows belong to, in order
        state = torch.stack(states)  # [R, H]: the head's state at each one's last drafted position
        for step in range(max(k for _, k in todo)):
            guess = self.target.compute_logits(state)[:, : self.vocab_size].argmax(dim=-1)
            guesses.append((active, guess))
            more = [(row, i) for row, i in enumerate(active) if todo[i][1] > step + 1]
            if not more:
                break
            # the head at position q + 1 + step, on the draft just made (q: the second-to-last known)
            more.sort(key=lambda ri: todo[ri[1]][0].num_tokens)  # decode rows by context length
            subs = [ScheduledChunk(todo[i][0], todo[i][0].num_tokens - 1 + step, 1) for _, i in more]
            rows = torch.tensor([row for row, _ in more], device=state.device)
            state = self._run(runner, subs, guess[rows], state[rows], step + 1)
            active = [i for _, i in more]
        made: list[list[int]] = [[] for _ in todo]
        flat = torch.cat([g for _, g in guesses]).tolist()  # the one wait on the device
        at = 0
        for entries, _ in guesses:
            for i in entries:
                made[i].append(int(flat[at]))
                at += 1
        return made

    def _run(self, runner: Any, subs: list[ScheduledChunk], next_ids: list[int] | torch.Tensor,
             hidden: torch.Tensor, step: int) -> torch.Tensor:  # fmt: skip
        """The head over `subs` (in the runner's order), `next_ids` and `hidden` row for row."""
        # `subs` reach past the known tokens (accepted drafts not appended yet, a further draft's
        # position): `ahead` keeps each one's rows where `hidden` has them, with placeholder ids
        inputs = runner.prepare(subs, ahead=True)
        ctx = ForwardContext(runner.attn, inputs.meta, runner.kv_cache, runner.states)
        ids = torch.as_tensor(next_ids, dtype=torch.int64, device=hidden.device)
        # NOTE: Triton launches on the current CUDA device, whatever its tensors' device (as runner.py)
        with torch.cuda.device(hidden.device) if hidden.device.type == "cuda" else nullcontext():
            return self.head(self.target, ids, hidden, inputs.positions, ctx, step)


class _Piece(NamedTuple):
    """The positions of one chunk of a step that the head's catch-up runs over."""

    index: int  # the chunk's index in the step
    rows: range  # its rows in the target's hidden states (the runner's order)
    sub: ScheduledChunk  # its first positions, those whose next token is known
    next_ids: list[int]  # the token after each of them


def _pieces(chunks: Sequence[ScheduledChunk], produced: dict[int, list[int]]) -> list[_Piece]:
    """The catch-up's pieces of the step `chunks`, in the runner's row order (a hybrid model's step has
    no decode rows of verify chunks); `produced` as `MTPDrafter.catch_up` takes it."""
    pieces: list[_Piece] = []
    row = 0
    for index, c in sorted(enumerate(chunks), key=lambda ic: order_key(ic[1])):
        req = c.request
        known_end = c.start + c.num_tokens - len(c.drafts)  # positions before it hold known tokens
        nxt = req.token_ids(c.start + 1, min(req.num_tokens, known_end + 1)) + produced.get(id(req), [])
        n = min(len(nxt), c.num_tokens)
        if n > 0:
            pieces.append(_Piece(index, range(row, row + n), ScheduledChunk(req, c.start, n), list(nxt[:n])))
        row += c.num_tokens
    return pieces
