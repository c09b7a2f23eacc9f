"""The grammar bitmask kernel (kernels/bitmask.py) against the torch unpack, on the CPU under Triton's
interpreter: random words (sign bits included), a vocabulary that ends mid-word and mid-block, logits
rows with padding past the vocabulary (left untouched)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.bitmask import BLOCK, apply_bitmask_  # noqa: E402


@pytest.mark.parametrize("vocab", [BLOCK, BLOCK + 77, 100])
def test_apply_bitmask_matches_the_torch_unpack(vocab):
    g = torch.Generator().manual_seed(vocab)
    rows, words = 3, -(-vocab // 32) + 1  # a spare word: bits past the vocabulary are ignored
    bitmask = torch.randint(-(2**31), 2**31, (rows, words), dtype=torch.int32, generator=g)
    padded = torch.randn(rows, vocab + 7, generator=g)
    logits = padded[:, :vocab]  # rows of stride vocab + 7
    before = padded.clone()
    bits = torch.arange(32, dtype=torch.int32)
    banned = ((bitmask[:, :, None] >> bits) & 1 == 0).reshape(rows, -1)[:, :vocab]
    expected = before[:, :vocab].masked_fill(banned, float("-inf"))
    assert apply_bitmask_(logits, bitmask) is logits
    assert torch.equal(padded[:, :vocab], expected)
    assert torch.equal(padded[:, vocab:], before[:, vocab:])
    assert 0 < int(banned.sum()) < banned.numel()


def test_apply_bitmask_checks_shapes():
    with pytest.raises(ValueError, match="int32"):
        apply_bitmask_(torch.zeros(2, 64), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError, match="cover"):
        apply_bitmask_(torch.zeros(2, 65), torch.zeros(2, 2, dtype=torch.int32))
