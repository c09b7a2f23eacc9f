"""The M = 1 GEMV (kernels/gemv.py) against F.linear, fp32 under TRITON_INTERPRET=1 (see conftest.py):
shapes that divide the tiles and shapes that do not, with and without bias; and which layers take it."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from splitserve.kernels.gemv import GEMV_MAX_N, gemv, use_gemv  # noqa: E402


@pytest.mark.parametrize("n, k", [(64, 1024), (40, 700), (7, 96), (24, 2048)])
@pytest.mark.parametrize("bias", [False, True])
@torch.inference_mode()
def test_gemv_equals_linear(n: int, k: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(n * k)
    x, w = torch.randn(1, k, generator=gen), torch.randn(n, k, generator=gen)
    b = torch.randn(n, generator=gen) if bias else None
    want = F.linear(x, w, b)
    torch.testing.assert_close(gemv(x, w, b), want, rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gemv(x, w, b, block_n=16, block_k=256), want, rtol=1e-5, atol=1e-4)


def test_gemv_refuses_what_it_cannot_do() -> None:
    with pytest.raises(ValueError, match=r"x \[1, K\]"):
        gemv(torch.randn(2, 8), torch.randn(4, 8))
    with pytest.raises(ValueError, match="contiguous"):
        gemv(torch.randn(1, 8), torch.randn(8, 4).t())


def test_only_one_cuda_row_of_16_bit_weights_takes_it() -> None:
    x, w = torch.randn(1, 8), torch.randn(4, 8)
    assert not use_gemv(x, w)  # CPU
    assert not use_gemv(x.bfloat16(), w.bfloat16())  # still the CPU
    if torch.cuda.is_available():  # pragma: no cover - CI has no GPU
        xc, wc = x.cuda().bfloat16(), w.cuda().bfloat16()
        assert use_gemv(xc, wc) and not use_gemv(xc.float(), wc.float())
        assert not use_gemv(torch.cat([xc, xc]), wc)
        assert not use_gemv(
            torch.randn(1, 8, device="cuda").bfloat16(), torch.randn(GEMV_MAX_N + 1, 8).cuda().bfloat16()
        )
