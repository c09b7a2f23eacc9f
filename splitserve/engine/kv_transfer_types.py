"""The records a disaggregated request travels with, and the errors of a KV import.

KVExport      prefill -> (router) -> decode: the KV handle and the sampler's generator state
              (wire/kv_handle.py: the one struct on every wire)
ImportSpec    what a decode engine is asked to continue (prompt, first token, params, handle)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.engine.request import Request
from splitserve.engine.sampler import replay_draw
from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams
from splitserve.transport import KVHandle
from splitserve.wire.kv_handle import KVExport


class KVTransferFailed(RuntimeError):
    """A request's KV could not be imported and its policy is "fail" (or the peer was refused)."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        self.request_id = request_id
        self.cause = cause
        self.kind = type(cause).__name__
        super().__init__(f"KV transfer for request {request_id!r} failed ({self.kind}): {cause}")


class NoRoom(TimeoutError):
    """The decode engine had no free blocks (or state slot) for the prompt before the deadline."""


@dataclass(frozen=True)
class ImportSpec:
    """Everything a decode engine needs to continue a request prefilled elsewhere."""

    handle: KVHandle
    prompt_token_ids: list[int]
    first_token: int
    params: SamplingParams
    request_id: str
    generator_state: bytes | None = None
    first_logprob: TokenLogprob | None = None
    policy: str | None = None  # None: the connector's
    timeout_s: float | None = None  # the whole import (room + fetch); None: the connector's


def restore_generator(req: Request, state: bytes | None, vocab_size: int) -> None:
    """Put a seeded request's generator where the prefill engine's was after the first token."""
    if req.generator is None:
        return
    if state is not None:
        try:
            req.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        except (RuntimeError, ValueError) as exc:
            raise ValueError(f"generator_state does not fit this engine's generator: {exc}") from exc
    elif not req.params.greedy:
        replay_draw(req.generator, vocab_size)  # the sampler's one draw for the first token


def payload_nbytes(handle: KVHandle, state: dict[str, torch.Tensor], kv: torch.Tensor) -> int:
    block = kv[0].numel() * kv.element_size()
    return handle.num_blocks * block + sum(
        t.numel() * t.element_size() for t in state.values() if isinstance(t, torch.Tensor)
    )


__all__ = ["ImportSpec", "KVExport", "KVTransferFailed", "NoRoom", "payload_nbytes", "restore_generator"]
