"""The hybrid prefill's kernels on the GPU against torch: the varlen causal conv (whole tiles inside a
chunk and tiles across chunk starts, the q | k | v split, its fused q/k L2 norm against fla's), and the
attention output gate.

Skipped without a GPU (CI has none; tests/kernels checks the same kernels under Triton's interpreter).
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

DEV = "cuda"


def _conv_case(lens: list[int], c: int, key_dim: int):
    from splitserve.model import gdn_prefill
    from splitserve.model.attention import AttentionMetadata, PrefillChunk

    gen = torch.Generator(device=DEV).manual_seed(0)
    t, kw = sum(lens), 4
    x = torch.randn(t, c + 64, device=DEV, generator=gen).to(torch.bfloat16)[:, 32 : 32 + c]  # strided
    pool = torch.randn(len(lens) + 2, 3, c, kw - 1, device=DEV, generator=gen)[:, 1]  # one layer's view
    pool = pool.to(torch.bfloat16).float()
    weight = (torch.randn(c, 1, kw, device=DEV, generator=gen) * 0.5).to(torch.bfloat16)
    chunks, start = [], 0
    for n in lens:
        chunks.append(PrefillChunk(start, n, n, None))
        start += n
    slots = torch.randperm(len(lens) + 2, device=DEV)[: len(lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(t, dtype=torch.int64, device=DEV),
        num_decode_tokens=0,
        decode_groups=(),
        prefills=tuple(chunks),
        seq_slots=slots,
    )
    return x, pool, weight, gdn_prefill.build_linear_prefill(meta, x.device), slots


@pytest.mark.parametrize("lens", [[1, 2, 9, 70, 512], [4096], [33, 16, 17, 600]])
def test_conv_varlen_matches_torch(lens):
    from splitserve.kernels.causal_conv_varlen import (
        causal_conv1d_varlen,
        causal_conv1d_varlen_split,
        conv1d_varlen_update_states,
    )

    c, key_dim = 1024, 256
    x, pool, weight, lp, slots = _conv_case(lens, c, key_dim)
    ref_pool = pool.clone()
    out = causal_conv1d_varlen(x, pool, weight, lp.cu_seqlens, lp.token_seq, lp.slots)
    q, k, v = causal_conv1d_varlen_split(x, pool, weight, lp.cu_seqlens, lp.token_seq, lp.slots, key_dim)
    assert torch.equal(torch.cat([q, k, v], dim=1), out)  # the split is a layout, not other arithmetic
    conv1d_varlen_update_states(x, pool, lp.cu_seqlens, lp.slots)
    start = 0
    for n, slot in zip(lens, slots.tolist(), strict=True):  # the torch prefill conv, in fp32
        seq = torch.cat([ref_pool[slot], x[start : start + n].T.float()], dim=-1)  # [C, K - 1 + n]
        conv = F.conv1d(seq[None], weight.float(), groups=c)[0].T
        ref = F.silu(conv.to(torch.bfloat16).float()).to(torch.bfloat16)
        torch.testing.assert_close(out[start : start + n], ref, rtol=1.6e-2, atol=1e-2)
        ref_pool[slot] = seq[:, -3:]
        start += n
    assert torch.equal(pool, ref_pool)


@pytest.mark.parametrize("lens", [[1, 2, 9, 70, 512], [4096]])
def test_conv_qk_norm_matches_fla_l2norm(lens):
    """The split conv's fused q/k L2 norm against the unfused split followed by fla's `l2norm_fwd` (what
    fla's rule runs with use_qk_l2norm_in_kernel): equal but for rare last bits (the two kernels sum a
    row's squares in different orders), v untouched."""
    fla_norm = pytest.importorskip("fla.modules.norm.l2norm")
    from splitserve.kernels.causal_conv_varlen import causal_conv1d_varlen_split

    c, key_dim, dk = 2 * 512 + 1024 + 64, 512, 128  # 4 key heads; v's last tile ends inside
    x, pool, weight, lp, _ = _conv_case(lens, c, key_dim)
    args = (x, pool, weight, lp.cu_seqlens, lp.token_seq, lp.slots, key_dim)
    q, k, v = causal_conv1d_varlen_split(*args)
    nq, nk, nv = causal_conv1d_varlen_split(*args, qk_norm_dim=dk)
    assert torch.equal(nv, v)
    for got, raw in ((nq, q), (nk, k)):
        want = fla_norm.l2norm_fwd(raw.view(-1, key_dim // dk, dk))[0].view_as(raw)
        torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)
        assert (got != want).float().mean() < 1e-3


def test_sigmoid_gate_mul_matches_torch():
    from splitserve.kernels.fused import sigmoid_gate_mul

    t, heads, d = 300, 16, 256
    gen = torch.Generator(device=DEV).manual_seed(1)
    x = torch.randn(t, heads * d, device=DEV, generator=gen).to(torch.bfloat16)
    qkv = torch.randn(t, 2 * heads * d + 2048, device=DEV, generator=gen).to(torch.bfloat16)
    gate = qkv[:, : 2 * heads * d].view(t, heads, 2 * d)[..., d:].reshape(t, heads * d)
    want = x * torch.sigmoid(gate)
    got = sigmoid_gate_mul(x, qkv, heads, d)
    torch.testing.assert_close(got, want, rtol=8e-3, atol=1e-3)
    assert (got != want).float().mean() < 1e-3  # torch's roundings: equal but for rare last bits
