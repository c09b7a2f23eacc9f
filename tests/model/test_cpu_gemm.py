"""The small-batch CPU matmul (kernels/cpu/gemm.py): F.linear's products from packed panels, each output
one sum in k order, so that a row's result depends neither on its batch nor on the threads."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels.cpu import gemm as cpu_gemm


@pytest.fixture(scope="module", autouse=True)
def op() -> None:
    if not cpu_gemm.load(force=True):
        pytest.skip("no AVX-512 on this host: the op is not built here")


@pytest.mark.parametrize(("k", "n"), [(576, 960), (64, 40), (1536, 576), (48, 7), (33, 65)])
@pytest.mark.parametrize("bias", [True, False])
def test_panels_give_f_linears_products(k: int, n: int, bias: bool) -> None:
    gen = torch.Generator().manual_seed(k * n)
    w, b = torch.randn(n, k, generator=gen), torch.randn(n, generator=gen) if bias else None
    panels = cpu_gemm.pack(w)
    assert panels.shape == (-(-n // cpu_gemm.PANEL), k, cpu_gemm.PANEL)
    for rows in (1, 2, 5, 12, 13, 64, cpu_gemm.MAX_ROWS):
        x = torch.randn(rows, k, generator=gen)
        torch.testing.assert_close(cpu_gemm.matmul(x, panels, n, b), F.linear(x, w, b), rtol=1e-5, atol=2e-4)
    x3 = torch.randn(2, 3, k, generator=gen)
    assert cpu_gemm.matmul(x3, panels, n, b).shape == (2, 3, n)


def test_a_rows_result_does_not_depend_on_its_batch_or_the_threads() -> None:
    gen = torch.Generator().manual_seed(1)
    w = torch.randn(3072, 576, generator=gen)
    panels = cpu_gemm.pack(w)
    x = torch.randn(64, 576, generator=gen)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        whole = cpu_gemm.matmul(x, panels, 3072, None)
        torch.set_num_threads(1)
        assert torch.equal(cpu_gemm.matmul(x, panels, 3072, None), whole)
    finally:
        torch.set_num_threads(before)
    for lo, hi in ((0, 1), (5, 7), (11, 40), (63, 64)):
        assert torch.equal(cpu_gemm.matmul(x[lo:hi], panels, 3072, None), whole[lo:hi])


def test_bad_shapes_are_refused() -> None:
    panels = cpu_gemm.pack(torch.randn(40, 64))
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_gemm.matmul(torch.randn(2, 64), panels, 70, None)  # 70 outputs from 2 panels of 32
    with pytest.raises(RuntimeError, match="do not fit"):
        cpu_gemm.matmul(torch.randn(2, 63), panels, 40, None)
    with pytest.raises(RuntimeError, match="bias"):
        cpu_gemm.matmul(torch.randn(2, 64), panels, 40, torch.randn(39))
