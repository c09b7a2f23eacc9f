"""The fused Triton kernels and the fused dense-decoder forward against the plain torch path (fp32,
on CPU under TRITON_INTERPRET=1, see conftest.py)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from splitserve.kernels.fused import qk_norm_rope_store, rmsnorm, silu_mul  # noqa: E402
from splitserve.model.attention import (  # noqa: E402
    AttentionMetadata,
    DecodeGroup,
    PrefillBatch,
    PrefillChunk,
    TorchPagedAttention,
    TritonPagedAttention,
    store_kv,
)
from splitserve.model.decoder import ForwardContext  # noqa: E402
from splitserve.model.layers import RMSNorm  # noqa: E402
from splitserve.model.random_weights import TINY_QWEN3, random_model  # noqa: E402


@torch.inference_mode()
def test_rmsnorm_and_residual_add() -> None:
    x, res = torch.randn(5, 48), torch.randn(5, 48)
    norm = RMSNorm(48, 1e-6)
    norm.weight.data = torch.randn(48)
    torch.testing.assert_close(rmsnorm(x, norm.weight, 1e-6), norm(x))
    summed = res + x
    residual = res.clone()
    out = rmsnorm(x, norm.weight, 1e-6, residual=residual)
    torch.testing.assert_close(residual, summed)
    torch.testing.assert_close(out, norm(summed))


def test_silu_mul() -> None:
    x = torch.randn(3, 2 * 1500)
    gate, up = x.chunk(2, dim=-1)
    torch.testing.assert_close(silu_mul(x), F.silu(gate) * up)


@pytest.mark.parametrize("qk_norm", [True, False])
@torch.inference_mode()
def test_qk_norm_rope_store(qk_norm: bool) -> None:
    t, h, kvh, d, bs = 6, 4, 2, 32, 4
    model = random_model({**TINY_QWEN3, "head_dim": d}, "cpu", torch.float32, 64)
    attn = model.model.layers[0].self_attn
    rope = model.model.rope
    qkv = torch.randn(t, (h + 2 * kvh) * d)
    positions = torch.tensor([0, 1, 2, 9, 17, 33])
    slots = torch.tensor([3, 5, 6, 12, 13, 30])
    kv = torch.zeros(10, 1, 2, bs, kvh, d)
    want_kv = kv.clone()
    q, k, v = qkv.split([h * d, kvh * d, kvh * d], dim=-1)
    q, k, v = q.view(t, h, d), k.view(t, kvh, d), v.view(t, kvh, d)
    if qk_norm:
        q, k = attn.q_norm(q), attn.k_norm(k)
    q, k = rope(positions, q, k)
    store_kv(want_kv[:, 0, 0], want_kv[:, 0, 1], k, v, slots)
    got = qk_norm_rope_store(
        qkv, h, kvh, positions, rope.cos, rope.sin, kv[:, 0, 0], kv[:, 0, 1], slots,
        attn.q_norm.weight if qk_norm else None, attn.k_norm.weight if qk_norm else None, 1e-6,
    )  # fmt: skip
    torch.testing.assert_close(got, q)
    torch.testing.assert_close(kv, want_kv)


def test_fused_forward_equals_plain() -> None:
    """A step with two decode rows and a prefill chunk after a cached prefix: the fused forward with
    the Triton backend gives the plain forward's hidden states (and the same KV cache)."""
    loaded = random_model(TINY_QWEN3, "cpu", torch.float32, 128, std=0.1)
    model, cfg = loaded.model, loaded.config
    bs, nb = 4, 24
    shape = (nb, cfg.num_kv_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim)
    kv = torch.randn(shape)  # earlier tokens' K/V
    tables = torch.tensor([[1, 2, 3, 0], [4, 5, 6, 7]])
    lens = torch.tensor([10, 15])  # decode rows at positions 9 and 14
    ptable = torch.tensor([8, 9, 10, 11])
    # prefill chunk: positions 5..12 of a sequence whose first 5 tokens are cached
    positions = torch.cat([torch.tensor([9, 14]), torch.arange(5, 13)])
    slot = [1 * bs + 1, 7 * bs + 2] + [int(ptable[p // bs]) * bs + p % bs for p in range(5, 13)]
    ids = torch.randint(0, cfg.vocab_size, (10,))
    common = dict(
        slot_mapping=torch.tensor(slot),
        num_decode_tokens=2,
        decode_groups=(DecodeGroup(0, 2, tables, lens, num_splits=2),),
    )
    plain_meta = AttentionMetadata(**common, prefills=(PrefillChunk(2, 8, 13, ptable),))
    fused_meta = AttentionMetadata(
        **common,
        prefills=(PrefillChunk(2, 8, 13, None),),
        prefill_batch=PrefillBatch(torch.tensor([2]), torch.tensor([8]), torch.tensor([13]), ptable[None], 8),
    )
    kv_plain, kv_fused = kv.clone(), kv.clone()
    with torch.inference_mode():
        want = model(
            ids, positions, ForwardContext(TorchPagedAttention(cfg.head_dim**-0.5), plain_meta, kv_plain)
        )
        assert model.enable_fused_kernels()
        try:
            got = model(
                ids, positions, ForwardContext(TritonPagedAttention(cfg.head_dim**-0.5), fused_meta, kv_fused)
            )
        finally:
            model.fused = False
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(kv_fused, kv_plain, rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_zero_centred_rmsnorm() -> None:
    from splitserve.model.layers import ZeroCentredRMSNorm

    x, res = torch.randn(4, 40), torch.randn(4, 40)
    norm = ZeroCentredRMSNorm(40, 1e-6)
    norm.weight.data = torch.randn(40) * 0.1
    residual = res.clone()
    out = rmsnorm(x, norm.weight, 1e-6, residual=residual, zero_centred=True)
    torch.testing.assert_close(residual, res + x)
    torch.testing.assert_close(out, norm(res + x))


def test_fused_hybrid_forward_equals_plain() -> None:
    """Qwen3.5 with every fused kernel (norms, SiLU, gates, gated q/k path) and the Triton attention:
    the plain forward's hidden states, for decode rows and a prefill chunk after a cached prefix."""
    from tiny_configs import TINY_QWEN3_5

    from splitserve.engine.state_pool import StatePool

    loaded = random_model({**TINY_QWEN3_5, "architectures": ["Qwen3_5ForCausalLM"]}, "cpu", torch.float32, 64)
    model, cfg = loaded.model, loaded.config
    bs = 4
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((12, cfg.num_kv_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim), generator=gen)
    states = StatePool(model.state_shapes(), 3, torch.device("cpu"))
    for t in states.states.values():
        t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    tables = torch.tensor([[0, 1, 2], [3, 4, 0]])  # decode rows at positions 9 and 6
    ptable = torch.tensor([5, 6, 7])  # prefill of positions 3..10 after 3 cached tokens
    positions = torch.cat([torch.tensor([9, 6]), torch.arange(3, 11)])
    slot = [2 * bs + 1, 4 * bs + 2] + [int(ptable[p // bs]) * bs + p % bs for p in range(3, 11)]
    ids = torch.randint(0, cfg.vocab_size, (10,), generator=gen)
    common = dict(
        slot_mapping=torch.tensor(slot),
        num_decode_tokens=2,
        decode_groups=(DecodeGroup(0, 2, tables, torch.tensor([10, 7])),),
        seq_slots=torch.tensor([2, 0, 1]),
    )
    plain = AttentionMetadata(**common, prefills=(PrefillChunk(2, 8, 11, ptable),))
    fused = AttentionMetadata(
        **common,
        prefills=(PrefillChunk(2, 8, 11, None),),
        prefill_batch=PrefillBatch(torch.tensor([2]), torch.tensor([8]), torch.tensor([11]), ptable[None], 8),
    )
    scale = cfg.head_dim**-0.5
    runs = []
    with torch.inference_mode():
        for meta, attn in ((plain, TorchPagedAttention(scale)), (fused, TritonPagedAttention(scale))):
            if meta is fused:
                assert model.enable_fused_kernels()
            st = {name: t.clone() for name, t in states.states.items()}
            cache = kv.clone()
            runs.append((model(ids, positions, ForwardContext(attn, meta, cache, st)), cache, st))
    for m in model.modules():
        if hasattr(m, "fused"):
            m.fused = False
    (want, want_kv, want_st), (got, got_kv, got_st) = runs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)
    for name in want_st:
        torch.testing.assert_close(got_st[name], want_st[name], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_gdn_gates() -> None:
    from splitserve.kernels.fused import gdn_gates

    ab = torch.randn(5, 12) * 8  # a strided pair of slices, with values past softplus's threshold
    a, b = ab[:, :6], ab[:, 6:]
    a_log, dt = torch.randn(6), torch.randn(6)
    g, beta = gdn_gates(a, b, a_log, dt)
    torch.testing.assert_close(g, -a_log.exp() * F.softplus(a + dt))
    torch.testing.assert_close(beta, b.sigmoid())


@torch.inference_mode()
def test_sigmoid_gate_mul() -> None:
    from splitserve.kernels.fused import sigmoid_gate_mul

    t, heads, d = 3, 4, 16
    x = torch.randn(t, heads * d)
    qkv = torch.randn(t, 2 * heads * d + 40)  # per head [q | gate], then k and v
    gate = qkv[:, : 2 * heads * d].view(t, heads, 2 * d)[..., d:].reshape(t, heads * d)
    torch.testing.assert_close(sigmoid_gate_mul(x, qkv, heads, d), x * torch.sigmoid(gate))


@pytest.mark.parametrize("t, multi_row", [(3, False), (37, True)])
@torch.inference_mode()
def test_gated_rmsnorm(t: int, multi_row: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """One (token, head) row a program, and 16 a program (a long prefill's launch), the last partly
    masked: each row is normed alone either way."""
    from splitserve.kernels import fused
    from splitserve.kernels.fused import gated_rmsnorm
    from splitserve.model.layers import GatedRMSNorm

    if multi_row:
        monkeypatch.setattr(fused, "GATED_NORM_MULTI_ROW", 1)
    heads, d = 4, 16
    x = torch.randn(t, heads * d)
    z = torch.randn(t, 2 * heads * d)[:, heads * d :]  # a strided slice, as in the model
    norm = GatedRMSNorm(d, 1e-6)
    norm.weight.data = torch.randn(d)
    want = norm(x.reshape(-1, d), z.reshape(-1, d)).reshape(t, -1)
    torch.testing.assert_close(gated_rmsnorm(x, z, norm.weight, 1e-6), want)


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_one_token_forward_with_the_gemv_fusions_equals_plain(arch: str, monkeypatch) -> None:
    """One decode row (batch-1 decode) through the fused forward with kernels/gemv.py's fusions (the
    residual adds in the o_proj (or out_proj) and down_proj epilogues, the factored RMSNorms read by
    the projections after them, SiLU in down_proj), here in fp32 with the GEMV let onto the CPU: the plain
    forward's hidden state, KV cache and recurrent state."""
    from tiny_configs import TINY_QWEN3_5

    from splitserve.engine.state_pool import StatePool
    from splitserve.kernels import gemv

    monkeypatch.setattr(gemv, "use_gemv", lambda x, w: x.dim() == 2 and x.shape[0] == 1)
    calls = []
    into = gemv.gemv_into_residual
    monkeypatch.setattr(gemv, "gemv_into_residual", lambda *a, **k: calls.append(1) or into(*a, **k))
    config = TINY_QWEN3 if arch == "qwen3" else {**TINY_QWEN3_5, "architectures": ["Qwen3_5ForCausalLM"]}
    loaded = random_model(config, "cpu", torch.float32, 64, std=0.1)
    model, cfg = loaded.model, loaded.config
    bs, gen = 4, torch.Generator().manual_seed(5)
    kv = torch.randn((8, cfg.num_kv_layers, 2, bs, cfg.num_kv_heads, cfg.head_dim), generator=gen)
    states = StatePool(model.state_shapes(), 2, torch.device("cpu")).states  # none for Qwen3
    for t in states.values():
        t.copy_(torch.randn(t.shape, generator=gen) * 0.1)
    meta = AttentionMetadata(
        slot_mapping=torch.tensor([2 * bs + 1]),  # position 9: block 2 of the table
        num_decode_tokens=1,
        decode_groups=(DecodeGroup(0, 1, torch.tensor([[0, 1, 2]]), torch.tensor([10]), num_splits=2),),
        prefills=(),
        seq_slots=torch.tensor([1]) if states else None,
    )
    ids, positions = torch.randint(0, cfg.vocab_size, (1,), generator=gen), torch.tensor([9])
    scale = cfg.head_dim**-0.5
    runs = []
    with torch.inference_mode():
        for attn in (TorchPagedAttention(scale), TritonPagedAttention(scale)):
            if isinstance(attn, TritonPagedAttention):
                assert model.enable_fused_kernels()
            st, cache = {name: t.clone() for name, t in states.items()}, kv.clone()
            runs.append((model(ids, positions, ForwardContext(attn, meta, cache, st)), cache, st))
    for m in model.modules():
        if hasattr(m, "fused"):
            m.fused = False
    assert len(calls) == 2 * cfg.num_layers  # the mixer's output projection and down_proj
    (want, want_kv, want_st), (got, got_kv, got_st) = runs
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(got_kv, want_kv, rtol=1e-5, atol=1e-5)
    for name in want_st:
        torch.testing.assert_close(got_st[name], want_st[name], rtol=1e-5, atol=1e-5)
