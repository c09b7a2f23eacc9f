"""The CPU draw (engine/sampler.py `_inverse_cdf`): its tokens follow the distribution, a filtered-out
token is never drawn, and `replay_draw` moves a generator exactly as one row's draw does (a decode
engine that imports a seeded request without the generator state relies on that)."""

from __future__ import annotations

import torch

from splitserve.engine.sampler import _inverse_cdf, replay_draw


def test_frequencies_follow_the_distribution_and_zero_is_never_drawn() -> None:
    gen = torch.Generator().manual_seed(3)
    probs = torch.softmax(torch.randn(1, 40, generator=gen) * 2, dim=-1)
    probs[0, 7] = 0.0  # filtered out (top_k / top_p / min_p / a grammar leave zeros)
    probs /= probs.sum()
    rows = probs.expand(2000, 40).contiguous()
    tokens = torch.cat([_inverse_cdf(rows, [gen] * 2000) for _ in range(40)])  # 80,000 draws
    freq = torch.bincount(tokens, minlength=40).double() / tokens.numel()
    assert freq[7] == 0
    # 5 standard errors of a frequency around p, plus a little for p near 0
    bound = 5 * (probs[0].double() * (1 - probs[0].double()) / tokens.numel()).sqrt() + 1e-4
    assert ((freq - probs[0].double()).abs() <= bound).all(), (freq - probs[0].double()).abs().max()


def test_a_one_hot_row_always_draws_its_token() -> None:
    probs = torch.zeros(3, 50)
    probs[0, 0], probs[1, 49], probs[2, 17] = 1.0, 1.0, 1.0
    gen = torch.Generator().manual_seed(0)
    for _ in range(200):
        assert _inverse_cdf(probs, [gen] * 3).tolist() == [0, 49, 17]


def test_replay_draw_advances_the_generator_as_one_draw() -> None:
    probs = torch.softmax(torch.randn(1, 100), dim=-1)
    drawn, replayed = torch.Generator().manual_seed(9), torch.Generator().manual_seed(9)
    _inverse_cdf(probs, [drawn])
    replay_draw(replayed, 100)
    assert torch.equal(drawn.get_state(), replayed.get_state())
