"""One sampled token's log-probability, its rank and the top alternatives: what the engine records per
token and what the worker's stream lines and the router's answers carry."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    logprob: float
    rank: int  # 1 = the most likely token
    top: tuple[tuple[int, float], ...]  # the top alternatives, most likely first


__all__ = ["TokenLogprob"]
