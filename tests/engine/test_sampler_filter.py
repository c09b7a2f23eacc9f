"""The sampler's top_k / top_p filter (CPU: over the most likely candidates, a whole sort only where the
cut lies beyond them) against a whole-vocabulary sort, row by row, for mixed batches."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from splitserve.engine import sampler


def _reference(logits: torch.Tensor, top_k: list[int], top_p: list[float]) -> torch.Tensor:
    out = logits.clone()
    v = logits.shape[1]
    for i, (k, p) in enumerate(zip(top_k, top_p, strict=True)):
        if k == 0 and p >= 1:
            continue
        vals, order = logits[i].sort(descending=True)
        drop = torch.arange(v) >= (k if k > 0 else v)
        probs = torch.softmax(vals.masked_fill(drop, float("-inf")), dim=-1)
        drop |= probs.cumsum(-1) - probs > p
        drop[0] = False
        out[i, order] = vals.masked_fill(drop, float("-inf"))
    return out


@pytest.mark.parametrize("scale", [0.5, 3.0, 12.0])  # flat to peaked rows: top_p cut late and early
def test_filter_matches_a_whole_sort(scale: float) -> None:
    gen = torch.Generator().manual_seed(int(scale * 10))
    top_k = [0, 40, 0, 1, 5, 0, 300, 0]
    top_p = [0.9, 1.0, 1.0, 1.0, 0.5, 0.99, 0.8, 0.3]
    logits = torch.randn(len(top_k), 4096, generator=gen) * scale
    pairs = zip(top_k, top_p, strict=True)
    reqs = [SimpleNamespace(params=SimpleNamespace(min_p=0.0, top_k=k, top_p=p)) for k, p in pairs]
    out = sampler._filter(logits, reqs)
    ref = _reference(logits, top_k, top_p)
    assert torch.equal(out.isinf(), ref.isinf())
    torch.testing.assert_close(out[~out.isinf()], ref[~ref.isinf()], rtol=0, atol=0)
