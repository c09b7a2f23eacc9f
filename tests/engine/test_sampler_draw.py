"""The CPU draw (engine/sampler.py `_inverse_cdf`): its tokens follow the distribution, a filtered-out
token is never drawn, and `replay_draw` moves a generator exactly as one row's draw does (a decode
engine that imports a seeded request without the generator state relies on that). The same draw as
one C++ op (kernels/cpu/fused.py's `sample_rows`) gives the same tokens."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.sampler import _inverse_cdf, replay_draw
from splitserve.kernels.cpu import fused as cpu_fused


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


@pytest.fixture
def op() -> None:
    if not cpu_fused.load(force=True):
        pytest.skip("the CPU ops could not be built here (no C++ compiler)")


@pytest.mark.parametrize("temperature", [1.0, 0.7, 1.9])
def test_the_cpu_op_draws_the_torch_paths_tokens_from_the_same_numbers(op: None, temperature: float) -> None:
    """kernels/cpu/fused.py's `sample_rows` and `_inverse_cdf` over softmax(x / t), one uniform number
    per row from generators in the same state: the same tokens (only a number within ~1e-7 of a
    boundary between two tokens could tell their exps apart)."""
    g = torch.Generator().manual_seed(int(temperature * 10))
    logits = torch.randn(256, 49152, generator=g) * 4
    logits[:, 100:200] = float("-inf")  # filtered out
    a, b = torch.Generator().manual_seed(5), torch.Generator().manual_seed(5)
    expected = _inverse_cdf(torch.softmax(logits / temperature, dim=-1), [a] * 256)
    u = torch.cat([torch.rand(1, generator=b, dtype=torch.float64) for _ in range(256)])
    got = cpu_fused.sample_rows(logits, torch.full((256,), temperature), u)
    assert torch.equal(got, expected)
    assert not ((got >= 100) & (got < 200)).any()


def test_the_cpu_op_follows_the_distribution_and_takes_argmax_at_zero(op: None) -> None:
    g = torch.Generator().manual_seed(4)
    logits = torch.randn(1, 40, generator=g) * 2
    logits[0, 7] = float("-inf")
    rows = logits.expand(4000, 40).contiguous()
    tokens = torch.cat(
        [
            cpu_fused.sample_rows(rows, torch.ones(4000), torch.rand(4000, generator=g, dtype=torch.float64))
            for _ in range(20)
        ]
    )  # 80,000 draws
    probs = torch.softmax(logits[0].double(), dim=-1)
    freq = torch.bincount(tokens, minlength=40).double() / tokens.numel()
    assert freq[7] == 0
    bound = 5 * (probs * (1 - probs) / tokens.numel()).sqrt() + 1e-4
    assert ((freq - probs).abs() <= bound).all(), (freq - probs).abs().max()
    # t = 0: the first maximum, whatever u is; a strided view of a wider row is read in place
    wide = torch.randn(3, 70, generator=g)
    wide[1, 5] = wide[1, 9] = 50.0
    view = wide[:, :60]
    got = cpu_fused.sample_rows(view, torch.zeros(3), torch.full((3,), 0.999, dtype=torch.float64))
    assert got.tolist() == view.argmax(dim=-1).tolist() and got[1] == 5


def test_the_sampler_takes_the_same_tokens_with_and_without_the_op(op: None, monkeypatch) -> None:
    """engine/sampler.py with the op loaded and with its torch path: the same tokens from the same seed,
    for rows greedy, at temperatures, and filtered by top_k / top_p / min_p (the filter runs in torch
    first, then the op draws at temperature 1)."""
    from splitserve.engine.request import Request
    from splitserve.engine.sampler import Sampler
    from splitserve.sampling.params import SamplingParams

    params = [
        SamplingParams(temperature=0.0), SamplingParams(temperature=1.0), SamplingParams(temperature=0.6),
        SamplingParams(temperature=1.0, top_k=20), SamplingParams(temperature=0.8, top_p=0.9),
        SamplingParams(temperature=1.3, min_p=0.05),
    ]  # fmt: skip
    reqs = [Request(str(i), [1], p, eos_token_ids=(0,), max_tokens=8) for i, p in enumerate(params)]
    logits = torch.randn(len(reqs), 1000, generator=torch.Generator().manual_seed(2)) * 3
    runs = []
    for ready in (True, False):
        monkeypatch.setattr(cpu_fused, "ready", lambda ready=ready: ready)
        sampler = Sampler(1000, torch.device("cpu"), seed=11)
        runs.append([sampler(logits, reqs)[0] for _ in range(30)])
    assert runs[0] == runs[1]


def test_the_cpu_op_answers_a_token_for_rows_without_weight(op: None) -> None:
    """A row whose every token is filtered out (a grammar and a min_tokens ban can leave none), or with
    NaN or +inf logits, still gets an index inside the vocabulary (its first maximum), never a read
    outside the row."""
    x = torch.randn(4, 300)
    x[0] = float("-inf")
    x[1, 5] = float("nan")
    x[2, 17] = float("inf")
    x[3, :] = float("nan")
    got = cpu_fused.sample_rows(x, torch.ones(4), torch.full((4,), 0.5, dtype=torch.float64))
    assert ((got >= 0) & (got < 300)).all()
    assert got[2] == 17
