"""One sampled token's log-probability, its rank and the top alternatives: what the engine records per
token, and the one shape that carries it on every wire (the engine core's batches, the worker's
stream lines and /prefill answer, the router's reading of them)."""

from __future__ import annotations

import msgspec


class TokenLogprob(msgspec.Struct, frozen=True):
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # the top alternatives (token id, logprob), most likely first


__all__ = ["TokenLogprob"]
