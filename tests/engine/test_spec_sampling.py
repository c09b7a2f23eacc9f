"""Sampled speculative decoding keeps the target distribution: on a 6-token vocabulary whose target
model is a Markov chain, point-mass drafts (what n-gram drafting proposes) verified by rejection
sampling give sequences whose empirical distribution matches the chain's exact one (chi-square over
many seeded samples); the same test rejects two wrong rules (accept every draft; on rejection
resample from p without removing the draft)."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from splitserve.engine.spec.accept import accept_always, accept_sampled, draw

V = 6
K = 3
SAMPLES = 12_000
START = 0


def _chain() -> torch.Tensor:
    gen = torch.Generator().manual_seed(3)
    p = -torch.rand(V, V, generator=gen, dtype=torch.float64).log()  # Dirichlet(1) rows
    return (p / p.sum(dim=1, keepdim=True)).float()


def _draft_after(token: int) -> int:
    return (2 * token + 1) % V  # a fixed guess: right sometimes, not others


def _sequence(chain: torch.Tensor, rule: Callable, gen: torch.Generator, length: int) -> tuple[int, ...]:
    """`length` tokens after START, produced by verify runs of K point-mass drafts under `rule`."""
    out = [START]
    while len(out) <= length:
        drafts = [_draft_after(out[-1])]
        while len(drafts) < K:
            drafts.append(_draft_after(drafts[-1]))
        probs = chain[[out[-1], *drafts]]  # [K + 1, V]: row j is the target after draft j
        out += rule(probs, drafts, gen)
    return tuple(out[1 : length + 1])


def _wrong_residual(probs: torch.Tensor, drafts: list[int], gen: torch.Generator) -> list[int]:
    """Accepts with probability p(x), but resamples from p itself (the draft not taken out)."""
    out: list[int] = []
    for j, d in enumerate(drafts):
        if float(torch.rand(1, generator=gen, dtype=torch.float64)) < float(probs[j, d]):
            out.append(d)
            continue
        return [*out, draw(probs[j], gen)]
    return [*out, draw(probs[K], gen)]


def _chi_square(rule: Callable) -> tuple[float, float, float, float]:
    """(chi-square, its 1e-6 critical value) for the first two tokens' joint distribution, and the
    same for the fifth token's marginal (reached through bonus tokens and second runs)."""
    chain = _chain()
    gen = torch.Generator().manual_seed(0)
    seqs = [_sequence(chain, rule, gen, 5) for _ in range(SAMPLES)]
    first = chain[START].double()
    joint = {(a, b): float(first[a] * chain[a, b]) for a in range(V) for b in range(V)}
    fifth = torch.linalg.matrix_power(chain.double(), 5)[START]
    marginal = {(t,): float(fifth[t]) for t in range(V)}
    pairs = Counter(s[:2] for s in seqs)
    fifths = Counter(s[4:5] for s in seqs)
    return (*_stat(pairs, joint), *_stat(fifths, marginal))


def _stat(observed: Counter, expected: dict) -> tuple[float, float]:
    chi2 = sum((observed.get(c, 0) - SAMPLES * p) ** 2 / (SAMPLES * p) for c, p in expected.items())
    df = len(expected) - 1
    z = 4.753  # the standard normal's 1 - 1e-6 quantile; Wilson-Hilferty for chi-square's
    critical = df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3
    return chi2, critical


def test_rejection_sampling_keeps_the_target_distribution():
    chi_pairs, crit_pairs, chi_fifth, crit_fifth = _chi_square(accept_sampled)
    assert chi_pairs < crit_pairs and chi_fifth < crit_fifth


@pytest.mark.parametrize("rule", [accept_always, _wrong_residual])
def test_a_wrong_rule_fails_the_same_test(rule):
    chi_pairs, crit_pairs, chi_fifth, crit_fifth = _chi_square(rule)
    assert chi_pairs > 3 * crit_pairs or chi_fifth > 3 * crit_fifth
