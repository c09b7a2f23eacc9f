"""kernels/cpu/prefill.py's prompt attention against SDPA over the same keys: a whole prompt, a later
chunk of one (it also sees the earlier part, read from the cache), blocks scattered in the pool, and
query/KV head ratios of 1, 3 (the default model), 4, 6 and 7 (tiles of 48 lanes for 3 and 6, else
64). Runs only where the host has AVX-512."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels.cpu import prefill as cpu_prefill


@pytest.fixture(scope="module", autouse=True)
def op() -> None:
    if not cpu_prefill.load(force=True):
        pytest.skip("the op needs AVX-512 and a C++ compiler")


def _reference(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: int) -> torch.Tensor:
    """q [T, H, D] at positions ctx - T ..; k, v [ctx, KVH, D] -> SDPA with the causal mask, [T, H, D]."""
    t, h, _ = q.shape
    g = h // k.shape[1]
    rows = torch.arange(t)[:, None] + (ctx - t)
    mask = torch.arange(ctx)[None, :] <= rows
    keys = k.transpose(0, 1).repeat_interleave(g, dim=0)
    values = v.transpose(0, 1).repeat_interleave(g, dim=0)
    out = F.scaled_dot_product_attention(q.transpose(0, 1), keys, values, attn_mask=mask, scale=0.125)
    return out.transpose(0, 1)


@pytest.mark.parametrize(
    ("heads", "kv_heads", "tokens", "ctx", "block"),
    [(9, 3, 256, 256, 16), (9, 3, 100, 357, 16), (8, 8, 37, 37, 16), (8, 2, 70, 200, 32), (14, 2, 50, 50, 16),
     (9, 3, 1, 40, 16), (12, 2, 45, 60, 16)],
)  # fmt: skip
def test_prefill_attention_is_causal_attention_over_the_cached_keys(
    heads: int, kv_heads: int, tokens: int, ctx: int, block: int
) -> None:
    g = torch.Generator().manual_seed(heads * 1000 + tokens)
    d = 64
    k = torch.randn(ctx, kv_heads, d, generator=g)
    v = torch.randn(ctx, kv_heads, d, generator=g)
    q = torch.randn(tokens, heads, d, generator=g) * 2
    nblocks = (ctx + block - 1) // block
    table = torch.randperm(nblocks + 5, generator=g)[:nblocks]  # scattered, not in order
    k_cache = torch.full((nblocks + 5, block, kv_heads, d), float("nan"))  # unused rows: never read
    v_cache = torch.full_like(k_cache, float("nan"))
    for pos in range(ctx):
        k_cache[table[pos // block], pos % block] = k[pos]
        v_cache[table[pos // block], pos % block] = v[pos]
    got = cpu_prefill.prefill_attention(q, k_cache, v_cache, table, ctx, 0.125)
    torch.testing.assert_close(got, _reference(q, k, v, ctx), rtol=2e-5, atol=2e-5)


def test_prefill_attention_reads_strided_query_rows() -> None:
    """Without the fused ops q is a view into the QKV projection's output (rows wider than H * D)."""
    g = torch.Generator().manual_seed(7)
    qkv = torch.randn(30, (9 + 6) * 64, generator=g)
    q = qkv[:, : 9 * 64].view(30, 9, 64)
    k, v = torch.randn(30, 3, 64, generator=g), torch.randn(30, 3, 64, generator=g)
    table = torch.arange(2)
    k_cache = torch.zeros(2, 16, 3, 64)
    v_cache = torch.zeros(2, 16, 3, 64)
    k_cache.view(32, 3, 64)[:30] = k
    v_cache.view(32, 3, 64)[:30] = v
    got = cpu_prefill.prefill_attention(q, k_cache, v_cache, table, 30, 0.125)
    torch.testing.assert_close(got, _reference(q.contiguous(), k, v, 30), rtol=2e-5, atol=2e-5)


def test_fits_answers_the_ops_limits() -> None:
    cache = torch.zeros(2, 16, 3, 64)
    assert cpu_prefill.fits(torch.zeros(5, 9, 64), cache)
    assert not cpu_prefill.fits(torch.zeros(5, 9, 128)[..., :64], cache)  # heads 128 apart
    assert not cpu_prefill.fits(torch.zeros(5, 3 * 65, 64), cache)  # 65 query heads a KV head
    big = torch.zeros(2, 16, 1, 512)
    assert not cpu_prefill.fits(torch.zeros(5, 2, 512), big)  # head_dim above 256
