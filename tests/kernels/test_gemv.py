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


def _rms_ref(r: torch.Tensor, w: torch.Tensor, eps: float, zero_centred: bool) -> torch.Tensor:
    """kernels/fused.py's RMSNorm roundings in plain torch: stats in fp32, product in r's dtype."""
    n = r.float() * torch.rsqrt(r.float().pow(2).mean(-1, keepdim=True) + eps)
    return (n * (1 + w.float())).to(r.dtype) if zero_centred else w * n.to(r.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("zero_centred", [False, True])
@torch.inference_mode()
def test_a_normed_row_reads_as_its_rmsnorm(dtype: torch.dtype, zero_centred: bool) -> None:
    """residual += o_proj(x) in one GEMV's epilogue, which also writes what the next GEMV needs to
    read RMSNorm(residual) * w: the same, to bf16 rounding, as the add, the RMSNorm and F.linear."""
    from splitserve.kernels.gemv import gemv_into_residual, gemv_normed

    gen = torch.Generator().manual_seed(3)
    hidden, out = 96, 40  # 96 rows in tiles of 8 (even) and 40 outputs (uneven)
    x = torch.randn(1, 64, generator=gen).to(dtype)
    w_o = (torch.randn(hidden, 64, generator=gen) / 8).to(dtype)
    res = torch.randn(1, hidden, generator=gen).to(dtype)
    norm_w = (1 + torch.randn(hidden, generator=gen) / 4).to(dtype)
    w_up = (torch.randn(out, hidden, generator=gen) / 8).to(dtype)
    bias = torch.randn(out, generator=gen).to(dtype)
    want_res = (res.float() + F.linear(x.float(), w_o.float()).to(dtype).float()).to(dtype)
    normed = _rms_ref(want_res, norm_w, 1e-6, zero_centred)
    want = F.linear(normed.float(), w_up.float(), bias.float())

    got_res = res.clone()
    row = gemv_into_residual(x, w_o, None, got_res, norm_w, 1e-6, zero_centred)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    torch.testing.assert_close(got_res, want_res, **tol)
    assert row.residual is got_res and row.partials.shape == (12,)  # one sum per tile of 8 rows
    torch.testing.assert_close(row.partials.sum(), got_res.float().pow(2).sum(), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(gemv_normed(row, w_up, bias).float(), want, **tol)
    materialized = _rms_ref(got_res, norm_w, 1e-6, zero_centred).float()
    torch.testing.assert_close(row.materialize().float(), materialized, **tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@torch.inference_mode()
def test_down_proj_reads_silu_of_gate_times_up_and_adds_into_the_residual(dtype: torch.dtype) -> None:
    from splitserve.kernels.gemv import gemv_into_residual

    gen = torch.Generator().manual_seed(4)
    inter, hidden = 200, 48  # K = 200: no tile divides it
    gate_up = torch.randn(1, 2 * inter, generator=gen).to(dtype)
    w = (torch.randn(hidden, inter, generator=gen) / 8).to(dtype)
    bias = torch.randn(hidden, generator=gen).to(dtype)
    res = torch.randn(1, hidden, generator=gen).to(dtype)
    norm_w = torch.rand(hidden, generator=gen).to(dtype)
    gate, up = gate_up.float().chunk(2, dim=-1)
    act = (F.silu(gate).to(dtype).float() * up).to(dtype)  # silu_mul's roundings
    y = F.linear(act.float(), w.float(), bias.float()).to(dtype)
    want = (res.float() + y.float()).to(dtype)
    got = res.clone()
    row = gemv_into_residual(gate_up, w, bias, got, norm_w, 1e-6, silu=True)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 3e-2}
    torch.testing.assert_close(got, want, **tol)
    torch.testing.assert_close(row.scaled, (got.float() * norm_w.float()).to(dtype))
    torch.testing.assert_close(row.partials.sum(), got.float().pow(2).sum(), rtol=1e-5, atol=1e-3)
    with pytest.raises(ValueError, match="residual must be"):
        gemv_into_residual(gate_up, w, None, res[:, :10], norm_w, 1e-6, silu=True)
    with pytest.raises(ValueError, match="residual must be torch.float64"):
        gemv_into_residual(gate_up.double(), w.double(), None, res, norm_w, 1e-6, silu=True)
