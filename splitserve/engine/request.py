"""A request's state inside the engine, and the outputs the engine hands back.

Life of a request:
  1. `add_request` builds a `Request` (status WAITING) with its prompt ids and params.
  2. The scheduler admits it (RUNNING), possibly reusing cached prefix blocks, and schedules chunks of
     its uncomputed tokens each step until `num_computed_tokens == num_tokens`; then every step
     computes one token and the sampler appends the next.
  3. It finishes (stop, length, abort) and its blocks go back to the pool, or it is preempted: blocks
     freed, `num_computed_tokens = 0`, back to the front of the waiting queue to be recomputed.
  (KV transfer, prefill/decode disaggregation: a request added with `export_kv` ends after its first
  token with its blocks held under a lease instead of freed; a decode engine's request whose prompt KV
  is elsewhere waits in WAITING_FOR_KV (the scheduler reserves its blocks, the connector fetches into
  them), then joins as WAITING with `num_computed_tokens = len(prompt)`. See kv_transfer_hooks.py.)
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from splitserve.engine.grammar import Matcher


class Status(enum.Enum):
    WAITING = "waiting"
    WAITING_FOR_KV = "waiting_for_kv"  # its prompt's KV is being fetched from another engine
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class KVWait:
    """A request in WAITING_FOR_KV, as the scheduler polls it."""

    room_by: float  # time.monotonic(): no room for the prompt by then fails the import (NoRoom)
    needs_room: bool = True  # False: a handle this engine cannot load (reserves nothing, fails)
    loading: bool = False  # room reserved (or not needed) and the load started, or given up


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: tuple[int, ...]
    max_tokens: int  # resolved from params and max_model_len
    parent_id: str | None = None  # set for the children of an n > 1 request
    index: int = 0
    leader: Request | None = None  # n > 1: wait until this sibling has prefilled the shared prompt
    arrival_time: float = field(default_factory=time.monotonic)
    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served by the prefix cache at admission
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)  # hashes of this request's full blocks
    num_cached_blocks: int = 0  # leading blocks already offered to the prefix cache
    state_slot: int | None = None  # hybrid models: the recurrent-state slot held while running
    restore_hash: bytes | None = None  # hybrid prefix hit: the checkpoint its slot starts from
    checkpoint_at: int | None = None  # hybrid: a shared prefix's end, where the state is checkpointed
    num_preemptions: int = 0
    generator: torch.Generator | None = None
    text: str = ""
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    scheduled_time: float | None = None  # first admitted to the running batch (queue time ends)
    first_token_time: float | None = None
    detokenizer: object | None = None
    export_kv: bool = False  # prefill role: lease the KV to the transport after the first token
    kv_export: object | None = (
        None  # prefill role: the `kv_transfer_types.KVExport` made when it was exported
    )
    grammar: Matcher | None = None  # a constrained request's matcher (engine/grammar.py)
    kv_wait: KVWait | None = None  # decode role: set while WAITING_FOR_KV
    draft_token_ids: list[int] = field(default_factory=list)  # speculative: to verify next step
    draft_pause: int = 0  # speculative back-off: steps left without drafting
    draft_misses: int = 0  # speculative back-off: verify steps in a row that accepted nothing
    head_lost: bool = False  # MTP: a position missed the head's catch-up; never drafts with it again

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def earlier_output(self) -> list[int]:
        """A migrated request's own earlier output: its prompt's last `params.resumed` tokens."""
        n = self.params.resumed
        return self.prompt_token_ids[len(self.prompt_token_ids) - n :] if n else []

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def token_ids(self, start: int, end: int) -> list[int]:
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    @property
    def finished(self) -> bool:
        return self.status is Status.FINISHED


@dataclass(frozen=True)
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: int | str | None = None
    logprobs: list[TokenLogprob] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict = field(default_factory=dict)
    # Prefill role: the `kv_transfer_types.KVExport` (KV handle + sampler state) when the request was
    # exported.
    # NOTE: such an output is `finished` (this engine is done) while its completion is not
    # (finish_reason None): generation continues on the decode worker that fetches the handle.
    kv_export: object | None = None


def output_of(request_id: str, children: list[Request]) -> RequestOutput:
    """The output of a request, from its samples (one when n == 1)."""
    head = children[0]
    return RequestOutput(
        request_id=request_id,
        prompt_token_ids=head.prompt_token_ids,
        outputs=[completion_of(c) for c in children],
        finished=all(c.finished for c in children),
        num_cached_tokens=head.num_cached_tokens,
        metrics={
            "arrival_time": head.arrival_time,
            "scheduled_time": head.scheduled_time,
            "first_token_time": head.first_token_time,
        },
        kv_export=head.kv_export,
    )


def completion_of(req: Request) -> CompletionOutput:
    text = req.text
    if req.params.stop and not req.finished:
        # Hold back a possible stop-string prefix, so streamed text never has to be taken back.
        hold = max(len(s) for s in req.params.stop) - 1
        text = text[: max(0, len(text) - hold)]
    return CompletionOutput(
        index=req.index,
        text=text,
        token_ids=list(req.output_token_ids),
        finish_reason=req.finish_reason,
        stop_reason=req.stop_reason,
        logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
    )
