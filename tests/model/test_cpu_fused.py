"""kernels/cpu/fused.py's C++ ops against the torch path they replace: the residual add and the rotary
embedding give the same bits, the KV store writes the same slots, the norms agree to fp32 rounding
(their sum of squares runs in another order). tests/engine/test_tiny_models.py runs whole models
through them against HF."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels.cpu import fused as cpu_fused
from splitserve.model.attention import store_kv
from splitserve.model.config import RopeConfig
from splitserve.model.layers import RMSNorm, RotaryEmbedding


@pytest.fixture(scope="module", autouse=True)
def ops() -> None:
    if not cpu_fused.load(force=True):
        pytest.skip("the CPU ops could not be built here (no C++ compiler)")


@pytest.mark.parametrize(("rows", "n", "add"), [(1, 576, True), (300, 576, True), (7, 100, False)])
def test_add_rms_norm_is_the_residual_add_then_rms_norm(rows: int, n: int, add: bool) -> None:
    g = torch.Generator().manual_seed(rows + n)
    x = torch.randn(rows, n, generator=g) * 3
    residual = torch.randn(rows, n, generator=g)
    weight = torch.randn(n, generator=g)
    expected_residual = residual + x if add else x
    out = cpu_fused.add_rms_norm(x, residual if add else None, weight, 1e-5)
    if add:
        assert torch.equal(residual, expected_residual)  # updated in place, the same bits
    torch.testing.assert_close(out, F.rms_norm(expected_residual, (n,), weight, 1e-5), rtol=2e-6, atol=1e-6)


def test_add_rms_norm_reads_a_strided_input() -> None:
    """The MLP's or attention's output may be a view with a row stride (a column slice)."""
    g = torch.Generator().manual_seed(1)
    wide = torch.randn(5, 96, generator=g)
    weight = torch.randn(64, generator=g)
    out = cpu_fused.add_rms_norm(wide[:, 16:80], None, weight, 1e-6)
    torch.testing.assert_close(out, F.rms_norm(wide[:, 16:80], (64,), weight, 1e-6), rtol=2e-6, atol=1e-6)


@pytest.mark.parametrize("tokens", [1, 17, 300])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_store_is_the_torch_rotary_and_store(tokens: int, qk_norm: bool) -> None:
    g = torch.Generator().manual_seed(tokens)
    h, kvh, d, bs, blocks, layers = 9, 3, 64, 16, 40, 4
    rope = RotaryEmbedding(RopeConfig(theta=100000.0), d, 4096)
    qkv = torch.randn(tokens, (h + 2 * kvh) * d, generator=g) * 4
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    slots = torch.randperm(blocks * bs, generator=g)[:tokens]
    q_norm, k_norm = RMSNorm(d, 1e-6), RMSNorm(d, 1e-6)
    with torch.no_grad():
        q_norm.weight.copy_(torch.randn(d, generator=g))
        k_norm.weight.copy_(torch.randn(d, generator=g))
        q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
        q, k, v = q.view(tokens, h, d), k.view(tokens, kvh, d), v.view(tokens, kvh, d)
        if qk_norm:
            q, k = q_norm(q), k_norm(k)
        q, k = rope(positions, q, k)
        ref_kv = torch.zeros(blocks, layers, 2, bs, kvh, d)
        store_kv(ref_kv[:, 2, 0], ref_kv[:, 2, 1], k, v, slots)
    kv = torch.zeros_like(ref_kv)
    norms = (q_norm.weight.detach(), k_norm.weight.detach(), 1e-6) if qk_norm else None
    q2, k2 = cpu_fused.rope_store(
        qkv, positions, rope.cos, rope.sin, kv[:, 2, 0], kv[:, 2, 1], slots, (h, kvh), norms
    )
    if qk_norm:  # the per-head norm's sum runs in another order
        torch.testing.assert_close(q2, q, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(k2, k, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv, ref_kv, rtol=1e-5, atol=1e-5)
    else:
        assert (q2 == q).all() and (k2 == k).all() and (kv == ref_kv).all()
    assert kv[:, [0, 1, 3]].abs().sum() == 0  # no other layer written


@pytest.mark.parametrize(("rows", "inner"), [(1, 1536), (300, 1536), (3, 13)])
def test_silu_mul_is_silu_of_the_gate_times_up(rows: int, inner: int) -> None:
    """As accurate as torch's (Sleef's exp against Cephes'), a contiguous result, and the edges:
    zeros, large magnitudes either side (no overflow of the exp), a tail shorter than a vector."""
    g = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * inner, generator=g) * 4
    x[0, :6] = torch.tensor([0.0, -0.0, 100.0, -100.0, 30.0, -30.0])
    out = cpu_fused.silu_mul(x)
    gate, up = x.chunk(2, dim=-1)
    exact = (gate.double() * torch.sigmoid(gate.double()) * up.double()).float()
    assert out.is_contiguous() and out.shape == (rows, inner)
    torch.testing.assert_close(out, exact, rtol=1e-6, atol=1e-30)
    torch.testing.assert_close(out, F.silu(gate) * up, rtol=1e-6, atol=1e-30)
