"""A greedy acceptance rule with a forced rate, for speculative-decoding tests on random weights (which
accept nothing by themselves): each draft is taken while a seeded coin lands under `rate`, then the
target's own token at the first row not taken. Patched in as `engine.spec.verify.accept_greedy`."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence

import torch


def forced_accept(rate: float, seed: int = 0) -> Callable[[torch.Tensor, Sequence[int]], list[int]]:
    rng = random.Random(seed)

    def accept(logits: torch.Tensor, drafts: Sequence[int]) -> list[int]:
        m = 0
        while m < len(drafts) and rng.random() < rate:
            m += 1
        return [*drafts[:m], int(logits[m].argmax())]

    return accept
