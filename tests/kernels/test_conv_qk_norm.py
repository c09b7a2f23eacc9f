"""The q/k L2 norm fused into the varlen conv's split output (kernels/causal_conv_varlen.py), under
Triton's interpreter: bit for bit the unfused conv followed by fla's `l2norm_fwd` arithmetic (fp32 from
the rounded conv output, 1 / sqrt(sum of squares + 1e-6), rounded back), across chunk starts inside a
tile, several chunks and a v plane that ends inside a tile; head dims the fused path cannot take fall
back to the plain conv. Then the layer: the rule normalizes q and k exactly when the conv did not."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("triton")

from gdn_meta import prefill_meta  # noqa: E402
from tiny_configs import TINY_QWEN3_5  # noqa: E402

from splitserve.kernels.causal_conv_varlen import can_fuse_qk_l2norm, causal_conv1d_varlen_split  # noqa: E402
from splitserve.model import gdn_prefill, qwen3_5  # noqa: E402
from splitserve.model.config import ModelConfig  # noqa: E402
from splitserve.model.decoder import ForwardContext  # noqa: E402

LENS = (1, 2, 9, 70, 21)  # chunk starts inside 16-row tiles, shorter than the window, whole tiles inside

pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _conv_inputs(c: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(3)
    kw, t = 4, sum(LENS)
    x = torch.randn(t, c + 8, generator=gen).to(dtype)[:, 4 : 4 + c]  # strided, as in_proj's split gives
    pool = torch.randn(8, c, kw - 1, generator=gen).to(dtype).float()
    weight = (torch.randn(c, 1, kw, generator=gen) * 0.5).to(dtype)
    lp = gdn_prefill.build_linear_prefill(
        prefill_meta(0, LENS, torch.tensor([5, 0, 3, 2, 7])), torch.device("cpu")
    )
    assert lp is not None
    return x, pool, weight, lp


def _fla_l2norm(y: torch.Tensor, dk: int) -> torch.Tensor:
    """fla's l2norm_fwd per head of dk channels: fp32, x * (1 / sqrt(sum(x * x) + eps)), rounded. The
    sum runs in numpy's order (the interpreter's `tl.sum`; a float sum's last bit depends on its order)
    and the square root is the correctly rounded one (torch's CPU sqrt is off by an ulp at times)."""
    f = y.view(y.shape[0], -1, dk).float()
    sq = torch.from_numpy(np.sum((f * f).numpy(), axis=-1, keepdims=True))
    root = torch.sqrt((sq + 1e-6).double()).float()  # fp64 sqrt rounded to fp32: the fp32 sqrt
    return (f * (1 / root)).to(y.dtype).view_as(y)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("dk, heads, vdim", [(16, 2, 40), (32, 1, 64)])
def test_fused_norm_equals_conv_then_fla_l2norm(dtype: torch.dtype, dk: int, heads: int, vdim: int):
    key_dim = heads * dk
    x, pool, weight, lp = _conv_inputs(2 * key_dim + vdim, dtype)
    before = pool.clone()
    args = (x, pool, weight, lp.cu_seqlens, lp.token_seq, lp.slots, key_dim)
    q, k, v = causal_conv1d_varlen_split(*args)
    nq, nk, nv = causal_conv1d_varlen_split(*args, qk_norm_dim=dk)
    assert torch.equal(pool, before)  # the windows are read only
    assert torch.equal(nv, v)  # v untouched (its last tile runs past the channels when vdim % dk != 0)
    assert torch.equal(nq, _fla_l2norm(q, dk)) and torch.equal(nk, _fla_l2norm(k, dk))
    norms = nq.view(-1, heads, dk).float().norm(dim=-1)
    torch.testing.assert_close(norms, torch.ones_like(norms), rtol=0, atol=1e-2)


def test_fusable_head_dims():
    assert can_fuse_qk_l2norm(2048, 128) and can_fuse_qk_l2norm(1024, 128)  # 9B, and its TP=2 shard
    assert can_fuse_qk_l2norm(512, 256) and can_fuse_qk_l2norm(16, 16)
    assert not can_fuse_qk_l2norm(36, 12)  # not a power of two
    assert not can_fuse_qk_l2norm(1024, 512)  # wider than a tile's channel block
    assert not can_fuse_qk_l2norm(48, 32)  # not whole heads


@pytest.mark.parametrize("dk, fused", [(16, True), (12, False)])
def test_varlen_conv_says_whether_it_normalized(dk: int, fused: bool):
    key_dim = 2 * dk
    x, pool, weight, lp = _conv_inputs(2 * key_dim + 24, torch.float32)
    ref = causal_conv1d_varlen_split(x, pool.clone(), weight, lp.cu_seqlens, lp.token_seq, lp.slots, key_dim)
    *qkv, normed = gdn_prefill.varlen_conv(lp, x, pool, weight, key_dim, dk)
    assert normed is fused
    want = (_fla_l2norm(ref[0], dk), _fla_l2norm(ref[1], dk), ref[2]) if fused else ref
    assert all(torch.equal(a, b) for a, b in zip(qkv, want, strict=True))


@pytest.mark.parametrize("conv_norm", [True, False])
def test_layer_normalizes_q_and_k_once(monkeypatch: pytest.MonkeyPatch, conv_norm: bool):
    """GatedDeltaNet's varlen path with the conv's norm on and off: the rule is asked to normalize
    exactly when the q and k it gets are not unit vectors, and the output matches the torch path."""
    cfg = ModelConfig.from_hf(
        {**TINY_QWEN3_5, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
    )
    lin = cfg.linear
    assert lin is not None
    torch.manual_seed(0)
    layer = qwen3_5.GatedDeltaNet(cfg, 1).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    gen = torch.Generator().manual_seed(5)
    states = {
        "conv": torch.randn(8, 3, lin.conv_dim, lin.conv_kernel - 1, generator=gen) * 0.2,
        "recurrent": torch.randn(
            8, 3, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim, generator=gen
        )
        * 0.2,
    }
    ref_states = {name: s.clone() for name, s in states.items()}
    meta = prefill_meta(2, LENS, torch.tensor([6, 1, 3, 0, 7, 4, 2]))
    x = torch.randn(2 + sum(LENS), cfg.hidden_size, generator=torch.Generator().manual_seed(2))
    seen = []

    def rule(q, k, *args, use_qk_l2norm_in_kernel: bool, **kw):  # noqa: ANN001, ANN202
        unit = all(torch.allclose(t.norm(dim=-1), torch.ones(()), atol=1e-5) for t in (q, k))
        seen.append((use_qk_l2norm_in_kernel, unit))
        kw["use_qk_l2norm_in_kernel"] = use_qk_l2norm_in_kernel
        return gdn_prefill.torch_varlen_rule(q, k, *args, **kw)

    with torch.no_grad():
        ref = layer(x, ForwardContext(attn=None, meta=meta, kv_cache=torch.empty(0), states=ref_states))
        monkeypatch.setattr(gdn_prefill, "VARLEN_RULE", rule)
        monkeypatch.setattr(gdn_prefill, "CONV_QK_NORM", conv_norm)
        layer.varlen = True
        lp = gdn_prefill.build_linear_prefill(meta, x.device)
        out = layer(x, ForwardContext(None, meta, torch.empty(0), states, linear_prefill=lp))
    assert seen == [(not conv_norm, conv_norm)]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name in states:
        torch.testing.assert_close(states[name], ref_states[name], rtol=1e-5, atol=1e-5)
