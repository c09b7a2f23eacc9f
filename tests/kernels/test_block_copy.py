"""The one-launch block copy of cuda_ipc (kernels/block_copy.py) against torch indexing, on the CPU
under Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.block_copy import STEPS, TILE, copy_rows  # noqa: E402


@pytest.mark.parametrize("width", [TILE, 3 * TILE * STEPS + 5, 17])
def test_copy_rows_scattered_both_sides(width):
    g = torch.Generator().manual_seed(0)
    src = torch.randint(-(2**62), 2**62, (12, width), dtype=torch.int64, generator=g)
    dst = torch.zeros((10, width), dtype=torch.int64)
    src_ids = torch.tensor([7, 0, 11, 3, 4])
    dst_ids = torch.tensor([2, 9, 0, 5, 6])
    before = dst.clone()
    copy_rows(src, dst, src_ids, dst_ids)
    expected = before.index_copy(0, dst_ids, src[src_ids])
    assert torch.equal(dst, expected)  # bit for bit, and rows not named are untouched


def test_copy_rows_checks_shapes():
    with pytest.raises(ValueError, match="one width"):
        copy_rows(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64),
                  torch.tensor([0]), torch.tensor([1]))  # fmt: skip
    with pytest.raises(ValueError, match="destination ids"):
        copy_rows(torch.zeros(2, 4, dtype=torch.int64), torch.zeros(2, 4, dtype=torch.int64),
                  torch.tensor([0, 1]), torch.tensor([1]))  # fmt: skip
