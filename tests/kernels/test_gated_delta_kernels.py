"""The fused Gated DeltaNet decode kernels (splitserve/kernels/gated_delta.py), run by Triton's
interpreter on CPU, against the torch decode path: the causal conv1d step and the recurrent gated
delta rule step over several decode steps, in place on non-contiguous state-pool views (one layer of a
[slots, layers, ...] pool), with shuffled slots and padded rows sharing a scratch slot. Real rows
must match the reference (fp32: to rounding; bf16: the same roundings), and no slot other than the
real ones and the scratch one may change. Last, GatedDeltaNet.forward with the kernels forced on
(SPLITSERVE_TRITON_INTERPRET_TEST=1) against its torch path on a mixed decode + prefill batch."""

from __future__ import annotations

import pytest  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

pytest.importorskip("triton")

from tiny_configs import TINY_QWEN3_5  # noqa: E402

from splitserve.kernels.gated_delta import (  # noqa: E402
    causal_conv1d_update,
    fused_recurrent_gated_delta_rule_update,
)
from splitserve.model import gdn_layer, qwen3_5  # noqa: E402
from splitserve.model.attention import AttentionMetadata, PrefillChunk  # noqa: E402
from splitserve.model.config import ModelConfig  # noqa: E402
from splitserve.model.decoder import ForwardContext  # noqa: E402
from splitserve.model.gated_delta import recurrent_gated_delta_rule  # noqa: E402

NUM_SLOTS, NUM_LAYERS, LAYER = 9, 3, 1
SCRATCH = NUM_SLOTS - 1  # the slot every padded row carries
STEPS = 3
BF16_TOL = dict(rtol=8e-3, atol=1e-6)  # one bf16 rounding step apart at most


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


def _batch_slots(gen: torch.Generator, real: int, padded: int) -> torch.Tensor:
    """`real` distinct slots in random order (never the scratch one), then `padded` scratch slots."""
    perm = torch.randperm(SCRATCH, generator=gen)[:real]
    return torch.cat([perm, torch.full((padded,), SCRATCH)]).to(torch.int64)


def _check_pool(
    pool: torch.Tensor, before: torch.Tensor, ref_pool: torch.Tensor, real: torch.Tensor, **tol
) -> None:
    """The step's real slots of LAYER match the reference; all else but the scratch slot is as before."""
    torch.testing.assert_close(pool[real, LAYER], ref_pool[real, LAYER], **tol)
    keep = torch.ones(NUM_SLOTS, dtype=torch.bool)
    keep[real] = False
    keep[SCRATCH] = False
    assert torch.equal(pool[keep], before[keep])
    others = [i for i in range(NUM_LAYERS) if i != LAYER]
    assert torch.equal(pool[:, others], before[:, others])


# ------------------------------------------------------------------------------------ causal conv1d


def _conv_reference(x: torch.Tensor, conv_states: torch.Tensor, weight: torch.Tensor, slots: torch.Tensor):
    """GatedDeltaNet.forward's decode conv, as written there (weight [C, 1, K])."""
    window = torch.cat([conv_states[slots].to(x.dtype), x[:, :, None]], dim=-1)  # [B, C, K]
    conv_states[slots] = window[:, :, 1:].float()
    out = F.silu(F.conv1d(window.to(weight.dtype), weight, groups=x.shape[1])).to(window.dtype)
    return out[:, :, -1]


@pytest.mark.parametrize(
    "channels, kernel, dtype",
    [(48, 4, torch.float32), (600, 4, torch.float32), (37, 2, torch.float32), (96, 4, torch.bfloat16)],
)
def test_causal_conv1d_update(channels: int, kernel: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(channels + kernel)
    real, padded = 4, 3
    pool = torch.randn(NUM_SLOTS, NUM_LAYERS, channels, kernel - 1, generator=gen)
    ref_pool = pool.clone()
    weight = (torch.randn(channels, 1, kernel, generator=gen) * 0.5).to(dtype)
    tol = BF16_TOL if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    for _ in range(STEPS):
        slots = _batch_slots(gen, real, padded)
        # rows of a wider projection output, as `mixed[:nd]` is: not contiguous
        x = torch.randn(real + padded, channels + 5, generator=gen).to(dtype)[:, 2 : 2 + channels]
        ref = _conv_reference(x[:real], ref_pool[:, LAYER], weight, slots[:real])
        before = pool.clone()
        out = causal_conv1d_update(x, pool[:, LAYER], weight, slots)
        assert out.dtype == dtype and out.shape == (real + padded, channels)
        torch.testing.assert_close(out[:real], ref, **tol)
        # the stored window is exact: shifted values rounded to the activation dtype, then x
        _check_pool(pool, before, ref_pool, slots[:real], rtol=0, atol=0)
    if dtype == torch.float32:
        # `out=` and a [C, K] weight: same result, written into the given rows
        slots = _batch_slots(gen, real, 0)
        x = torch.randn(real, channels, generator=gen)
        dest = torch.zeros(real + 2, channels)
        ref = _conv_reference(x, ref_pool[:, LAYER], weight, slots)
        causal_conv1d_update(x, pool[:, LAYER], weight[:, 0], slots, out=dest[1 : real + 1])
        torch.testing.assert_close(dest[1 : real + 1], ref, **tol)
        assert not dest[0].any() and not dest[-1].any()


# --------------------------------------------------------------------------- recurrent delta rule


def _rule_inputs(gen: torch.Generator, b: int, hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype):
    """q, k, v as strided views of one conv_out-like row block (as in GatedDeltaNet), g fp32, beta."""
    mixed = torch.randn(b, 2 * hk * dk + hv * dv, generator=gen).to(dtype)
    q, k, v = mixed.split([hk * dk, hk * dk, hv * dv], dim=-1)
    q, k, v = q.view(b, hk, dk), k.view(b, hk, dk), v.view(b, hv, dv)
    g = -torch.rand(b, hv, generator=gen) * 0.7
    beta = torch.rand(b, hv, generator=gen).to(dtype)
    return q, k, v, g, beta


@pytest.mark.parametrize(
    "hk, hv, dk, dv, dtype",
    [
        (2, 4, 16, 32, torch.float32),  # grouped heads, as the tiny Qwen3.5
        (1, 2, 12, 20, torch.float32),  # not powers of two: masked
        (1, 1, 128, 64, torch.float32),  # the real head dim: two value tiles per head
        (2, 4, 16, 32, torch.bfloat16),
    ],
)
def test_recurrent_gated_delta_update(hk: int, hv: int, dk: int, dv: int, dtype: torch.dtype):
    gen = torch.Generator().manual_seed(dk * dv + hv)
    real, padded = 3, 2
    pool = torch.randn(NUM_SLOTS, NUM_LAYERS, hv, dk, dv, generator=gen) * 0.2
    ref_pool = pool.clone()
    tol = BF16_TOL if dtype == torch.bfloat16 else dict(rtol=1e-5, atol=1e-5)
    state_tol = dict(rtol=1e-5, atol=1e-5)  # fp32 state: only the order of fp32 sums differs
    for _ in range(STEPS):
        slots = _batch_slots(gen, real, padded)
        q, k, v, g, beta = _rule_inputs(gen, real + padded, hk, hv, dk, dv, dtype)
        r = slice(0, real)
        ref_out, ref_state = recurrent_gated_delta_rule(
            q[r, None], k[r, None], v[r, None], g[r, None], beta[r, None], ref_pool[slots[r], LAYER]
        )
        ref_pool[slots[r], LAYER] = ref_state
        before = pool.clone()
        out = fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, pool[:, LAYER], slots)
        assert out.dtype == dtype and out.shape == (real + padded, hv, dv)
        torch.testing.assert_close(out[r], ref_out[:, 0], **tol)
        _check_pool(pool, before, ref_pool, slots[r], **state_tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_recurrent_update_with_raw_gates_equals_gates_made_first(dtype: torch.dtype):
    """`raw_gates`: the kernel makes g and beta from in_proj's raw a, b (values past softplus's
    threshold too) as kernels/fused.py's gdn_gates does: the same output and state, bit for bit."""
    from splitserve.kernels.fused import gdn_gates

    gen = torch.Generator().manual_seed(3)
    hk, hv, dk, dv, rows = 2, 4, 16, 32, 3
    q, k, v, _, _ = _rule_inputs(gen, rows, hk, hv, dk, dv, dtype)
    ab = (torch.randn(rows, 2 * hv + 3, generator=gen) * 8).to(dtype)  # strided slices, as in_proj's
    a, b = ab[:, :hv], ab[:, hv : 2 * hv]
    a_log, dt_bias = torch.randn(hv, generator=gen), torch.randn(hv, generator=gen)
    slots = torch.tensor([4, 0, 2])
    pool = torch.randn(NUM_SLOTS, hv, dk, dv, generator=gen) * 0.2
    made = pool.clone()
    g, beta = gdn_gates(a, b, a_log, dt_bias)
    want = fused_recurrent_gated_delta_rule_update(q, k, v, g, beta, made, slots)
    got = fused_recurrent_gated_delta_rule_update(q, k, v, a, b, pool, slots, raw_gates=(a_log, dt_bias))
    assert torch.equal(got, want) and torch.equal(pool, made)


# ------------------------------------------------------------------------------- GatedDeltaNet layer


def test_gated_delta_net_decode_fused_matches_torch(monkeypatch):
    cfg = ModelConfig.from_hf(
        {**TINY_QWEN3_5, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
    )
    torch.manual_seed(0)
    layer = qwen3_5.GatedDeltaNet(cfg, LAYER).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    lin = cfg.linear
    assert lin is not None
    shapes = {  # as Qwen3_5LM.state_shapes, with NUM_LAYERS linear layers
        "conv": (NUM_SLOTS, NUM_LAYERS, lin.conv_dim, lin.conv_kernel - 1),
        "recurrent": (NUM_SLOTS, NUM_LAYERS, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim),
    }
    gen = torch.Generator().manual_seed(5)
    states = {name: torch.randn(shape, generator=gen) * 0.2 for name, shape in shapes.items()}
    ref_states = {name: s.clone() for name, s in states.items()}

    nd, prefill = 4, 5  # 3 real decode rows + 1 padded one (scratch slot), then a 5-token prefill chunk
    seq_slots = torch.tensor([6, 1, 3, SCRATCH, 4])
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(nd + prefill, dtype=torch.int64),
        num_decode_tokens=nd,
        decode_groups=(),
        prefills=(PrefillChunk(nd, prefill, prefill, torch.zeros(1, dtype=torch.int64)),),
        seq_slots=seq_slots,
    )
    x = torch.randn(nd + prefill, cfg.hidden_size, generator=gen)

    def run(st: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return layer(x, ForwardContext(attn=None, meta=meta, kv_cache=torch.empty(0), states=st))

    ref = run(ref_states)
    monkeypatch.setenv(gdn_layer.TRITON_ON_CPU_ENV, "1")
    kernels, calls = gdn_layer._decode_kernels(), []
    for name in ("causal_conv1d_update", "fused_recurrent_gated_delta_rule_update"):
        fn = getattr(kernels, name)
        monkeypatch.setattr(
            kernels, name, lambda *a, _fn=fn, _n=name, **kw: (calls.append(_n), _fn(*a, **kw))[1]
        )
    out = run(states)
    assert calls == ["causal_conv1d_update", "fused_recurrent_gated_delta_rule_update"]
    real = torch.tensor([0, 1, 2, 4, 5, 6, 7, 8])  # all rows but the padded one
    torch.testing.assert_close(out[real], ref[real], rtol=1e-5, atol=1e-5)
    used = seq_slots[seq_slots != SCRATCH]
    for name in states:
        torch.testing.assert_close(states[name][used], ref_states[name][used], rtol=1e-5, atol=1e-5)
        untouched = torch.tensor([i for i in range(SCRATCH) if i not in used.tolist()])
        assert torch.equal(states[name][untouched], ref_states[name][untouched])


def test_gated_delta_net_decode_runs_match_chunks(monkeypatch):
    """Decode rows in runs (`decode_steps`, a verify step laid out as decode rows: run j holds position
    j of each sequence) through the kernels, against each sequence as one prefill chunk by the torch
    rule: two sequences of 3 and 2 tokens, the second's last row and a third column padded."""
    cfg = ModelConfig.from_hf(
        {**TINY_QWEN3_5, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
    )
    torch.manual_seed(0)
    layer = qwen3_5.GatedDeltaNet(cfg, LAYER).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    lin = cfg.linear
    assert lin is not None
    gen = torch.Generator().manual_seed(6)
    states = {
        "conv": torch.randn(NUM_SLOTS, NUM_LAYERS, lin.conv_dim, lin.conv_kernel - 1, generator=gen) * 0.2,
        "recurrent": torch.randn(
            NUM_SLOTS, NUM_LAYERS, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim, generator=gen
        ) * 0.2,
    }  # fmt: skip
    ref_states = {name: s.clone() for name, s in states.items()}
    x = torch.randn(9, cfg.hidden_size, generator=gen)  # 3 runs of 3 columns
    runs = AttentionMetadata(
        slot_mapping=torch.zeros(9, dtype=torch.int64),
        num_decode_tokens=9,
        decode_groups=(),
        prefills=(),
        seq_slots=torch.tensor([6, 1, SCRATCH, 6, 1, SCRATCH, 6, SCRATCH, SCRATCH]),
        decode_steps=3,
    )
    order = torch.tensor([0, 3, 6, 1, 4])  # the real rows, sequence by sequence
    chunks = AttentionMetadata(
        slot_mapping=torch.zeros(5, dtype=torch.int64),
        num_decode_tokens=0,
        decode_groups=(),
        prefills=(PrefillChunk(0, 3, 3, None), PrefillChunk(3, 2, 2, None)),
        seq_slots=torch.tensor([6, 1]),
    )

    def run(inp: torch.Tensor, meta: AttentionMetadata, st: dict[str, torch.Tensor]) -> torch.Tensor:
        with torch.no_grad():
            return layer(inp, ForwardContext(attn=None, meta=meta, kv_cache=torch.empty(0), states=st))

    ref = run(x[order], chunks, ref_states)
    monkeypatch.setenv(gdn_layer.TRITON_ON_CPU_ENV, "1")
    out = run(x, runs, states)
    torch.testing.assert_close(out[order], ref, rtol=1e-5, atol=1e-5)
    for name in states:
        torch.testing.assert_close(states[name][[6, 1]], ref_states[name][[6, 1]], rtol=1e-5, atol=1e-5)
        others = [i for i in range(SCRATCH) if i not in (6, 1)]
        assert torch.equal(states[name][others], ref_states[name][others])
