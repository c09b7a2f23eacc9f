"""Acceptance of draft tokens against the target model's logits at the verified positions.

Rows: logits[j] ([k + 1, V]) is the target's prediction for the position of draft j + 1 (row 0 follows
the last accepted token); the last row predicts the token after all k drafts (the bonus token).

Greedy: accept drafts while each equals its row's argmax; the first row that disagrees gives its argmax
instead (or, all accepted, the last row gives the bonus). The output is exactly what plain greedy
decoding would produce.

Sampled (rejection sampling, Leviathan et al. / Chen et al.): draft x, proposed with probability
q(x), is accepted with probability min(1, p(x) / q(x)); on rejection a token is drawn from
norm(max(0, p - q)) and the run ends; all accepted, the bonus is drawn from the last row. The tokens
so produced follow the target distribution p exactly. An n-gram draft is a point mass (q(x) = 1):
accept with probability p(x), and on rejection draw from p with x removed and renormalized.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def accept_greedy(logits: torch.Tensor, drafts: Sequence[int]) -> list[int]:
    """-> the tokens the step produces: the accepted drafts, then the correction or bonus token."""
    top = logits.argmax(dim=-1).tolist()  # [k + 1]
    out: list[int] = []
    for j, draft in enumerate(drafts):
        if top[j] != draft:
            return [*out, top[j]]
        out.append(draft)
    return [*out, top[len(drafts)]]


def accept_sampled(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator) -> list[int]:
    """`probs` [k + 1, V]: the target's distribution at each verified position (temperature and
    filters applied); the drafts are point masses. -> the tokens the step produces."""
    out: list[int] = []
    for j, draft in enumerate(drafts):
        p = probs[j]
        if _uniform(generator) < float(p[draft]):
            out.append(draft)
            continue
        residual = p.clone()
        residual[draft] = 0.0  # max(0, p - q) with q the point mass at the draft
        return [*out, draw(residual, generator)]
    return [*out, draw(probs[len(drafts)], generator)]


def accept_always(probs: torch.Tensor, drafts: Sequence[int], generator: torch.Generator) -> list[int]:
    """A wrong rule, kept for the statistical test to show that it fails: every draft accepted."""
    return [*drafts, draw(probs[len(drafts)], generator)]


def draw(weights: torch.Tensor, generator: torch.Generator) -> int:
    """One token drawn in proportion to `weights` [V] (not necessarily normalized): the first whose
    cumulative weight (fp64) passes u * the total; a token of weight 0 is never drawn."""
    cdf = weights.to(torch.float64).cumsum(dim=0)
    target = _uniform(generator) * float(cdf[-1])
    return int(torch.searchsorted(cdf, torch.tensor([target], dtype=torch.float64, device=cdf.device),
                                  right=True).clamp_(max=len(cdf) - 1))  # fmt: skip


def _uniform(generator: torch.Generator) -> float:
    return float(torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device))
