"""Each step's batch, from rank 0's scheduler to every rank, and the loop the other ranks run.

Rank 0 (`TPRunner.execute`): broadcast the step (the state journal since the last step, then each
scheduled chunk as plain data: its positions, the tokens it computes, its block table, its state slot),
then run its own shard of the model on it. Rank r (`serve_rank`): receive the step, replay the journal,
rebuild the chunks over stand-in requests and run its shard through the same `ModelRunner` code, so
the flat batch, the attention metadata and the sampled rows are the same on every rank. The model's
collectives (all-reduce after each row-parallel projection, the logits' all-gather) keep the ranks in
step; only rank 0 samples. `None` in place of a step tells the ranks to leave.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
from dataclasses import dataclass

import torch

from splitserve.engine.isolate import check_fault
from splitserve.engine.runner import Feed, ModelRunner
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.engine.state_cache import StateCheckpoints
from splitserve.engine.tp.group import TPGroup
from splitserve.engine.tp.journal import Op, replay
from splitserve.engine.tp.ranks import RankProcesses

log = logging.getLogger(__name__)

# (start, num_tokens, the request's known tokens, the tokens computed, block ids, state slot, drafts)
ChunkSpec = tuple[int, int, int, list[int], list[int], int | None, tuple[int, ...]]


@dataclass(frozen=True)
class Step:
    journal: list[Op]
    chunks: list[ChunkSpec]


def describe(c: ScheduledChunk) -> ChunkSpec:
    req = c.request
    known = c.num_tokens - len(c.drafts)
    tokens = list(req.token_ids(c.start, c.start + known))
    return (c.start, c.num_tokens, req.num_tokens, tokens, list(req.block_ids), req.state_slot, c.drafts)


class _RankRequest:
    """What the runner reads of a request, on a rank that does not schedule."""

    __slots__ = ("block_ids", "num_tokens", "request_id", "start", "state_slot", "tokens")

    def __init__(self, spec: ChunkSpec) -> None:
        self.start, _, self.num_tokens, self.tokens, self.block_ids, self.state_slot, _ = spec
        self.request_id = "tp-rank"

    def token_ids(self, start: int, end: int) -> list[int]:
        return self.tokens[start - self.start : end - self.start]


def rebuild(spec: ChunkSpec) -> ScheduledChunk:
    return ScheduledChunk(_RankRequest(spec), spec[0], spec[1], spec[6])  # type: ignore[arg-type]


class TPRunner(ModelRunner):
    """Rank 0's runner: every step goes to the other ranks before it runs here."""

    ranks: RankProcesses
    journal: list[Op]

    @property
    def group(self) -> TPGroup:
        return self.ranks.group

    @torch.inference_mode()
    def execute(
        self, chunks: list[ScheduledChunk], feed: Feed | None = None
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        assert feed is None, "tensor-parallel steps do not overlap"
        check_fault(chunks)  # before the broadcast: a step rank 0 refuses must not run elsewhere
        self.ranks.check()
        ops, self.journal[:] = list(self.journal), []
        try:
            self.group.broadcast(Step(ops, [describe(c) for c in chunks]))
            with _on_device(self.device):
                return self._execute(chunks, None)
        except BaseException as exc:  # the ranks ran (or wait in) a step this rank left: out of step for good
            self.ranks.broken(f"a tensor-parallel step failed on rank 0 ({type(exc).__name__}: {exc})")
            raise

    def start(self, ranks: RankProcesses, journal: list[Op]) -> None:
        """Drive `ranks` (started by the builder), sending `journal` with each step."""
        self.ranks, self.journal = ranks, journal
        atexit.register(self.close)

    def close(self) -> None:
        """Tell the other ranks to leave and wait for them (once; also at interpreter exit)."""
        if self.ranks.dead is None and not getattr(self, "_closed", False):
            self._closed = True
            with contextlib.suppress(RuntimeError):
                self.group.broadcast(None)
        self.ranks.stop()


def serve_rank(runner: ModelRunner, group: TPGroup, checkpoints: StateCheckpoints | None) -> None:
    """A rank other than 0: run every step rank 0 broadcasts, until it says stop."""
    while True:
        step: Step | None = group.broadcast()
        if step is None:
            return
        replay(step.journal, runner.states, checkpoints, group.rank)
        chunks = [rebuild(s) for s in step.chunks]
        with torch.inference_mode(), _on_device(runner.device):
            runner._execute(chunks, None)


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


__all__ = ["ChunkSpec", "Step", "TPRunner", "describe", "rebuild", "serve_rank"]
