"""The CPU fp32 shortcuts of model/layers.py give the same bits as the formulas they replace (which
match HF transformers step for step): RMSNorm through torch's fused kernel, rotary embedding from one
half of the cos/sin table with fewer temporaries."""

from __future__ import annotations

import pytest
import torch

from splitserve.model.config import RopeConfig
from splitserve.model.layers import RMSNorm, RotaryEmbedding, _apply


@pytest.mark.parametrize("shape", [(1, 576), (7, 64), (2048, 576), (33, 9, 64), (5, 4096)])
def test_rms_norm_cpu_is_the_five_op_formula(shape: tuple[int, ...]) -> None:
    g = torch.Generator().manual_seed(len(shape) * 1000 + shape[-1])
    x = torch.randn(shape, generator=g) * torch.rand(shape[0], *([1] * (len(shape) - 1)), generator=g) * 8
    norm = RMSNorm(shape[-1], 1e-5)
    with torch.no_grad():
        norm.weight.copy_(torch.randn(shape[-1], generator=g))
        reference = norm.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
        assert torch.equal(norm(x), reference)


@pytest.mark.parametrize("tokens", [1, 17, 300])
def test_rotary_cpu_is_the_rotate_half_formula(tokens: int) -> None:
    g = torch.Generator().manual_seed(tokens)
    h, kvh, d = 9, 3, 64
    rope = RotaryEmbedding(RopeConfig(theta=100000.0), d, 4096)
    qkv = torch.randn(tokens, (h + 2 * kvh) * d, generator=g) * 4
    q, k, _ = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k = q.view(tokens, h, d), k.view(tokens, kvh, d)  # strided views, as the decoder passes them
    positions = torch.randint(0, 4096, (tokens,), generator=g)
    out_q, out_k = rope(positions, q, k)
    cos, sin = rope.cos[positions].unsqueeze(1), rope.sin[positions].unsqueeze(1)
    assert torch.equal(out_q, _apply(q, cos, sin)) and torch.equal(out_k, _apply(k, cos, sin))
