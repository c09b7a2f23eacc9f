"""Fused Triton decode kernels for the Gated DeltaNet layers (Qwen3.5): the causal conv1d step and the
recurrent gated delta rule step, one token for each of B sequences.

Both work in place on the engine's state pools, addressed by per-sequence slot indices, so the decode
step never gathers or scatters state copies:

    conv_state  [num_slots, C, K - 1]        fp32, `states["conv"][:, layer]` (any strides)
    state       [num_slots, Hv, Dk, Dv]      fp32, `states["recurrent"][:, layer]` (any strides)
    slots       [B] int64                    each row's slot

The math is that of `GatedDeltaNet.forward`'s decode branch and `recurrent_gated_delta_rule`
(splitserve/model/gated_delta.py), including its roundings to the activation dtype, with fp32
accumulation. Neither kernel synchronizes with the host, so both can be captured in CUDA graphs. Rows
that share a slot (the padded rows of a CUDA-graph bucket all point at one scratch slot) race on that
slot's state; the rows whose slots are unique are unaffected.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.pdl import begin
from splitserve.kernels.pdl import on as pdl_on


@triton.jit
def _round_to(x, dtype: tl.constexpr):
    """fp32 `x` rounded (to nearest even) to `dtype`'s precision, kept as fp32. bf16 is rounded with
    integer ops, as Triton's interpreter truncates fp32 -> bf16 casts (compiled kernels round)."""
    if dtype == tl.bfloat16:
        bits = x.to(tl.uint32, bitcast=True)
        bits = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16 << 16
        return bits.to(tl.float32, bitcast=True)
    else:
        return x.to(dtype).to(tl.float32)


@triton.jit
def _causal_conv1d_update_kernel(
    x_ptr,
    state_ptr,
    w_ptr,
    slot_ptr,
    out_ptr,
    C,
    stride_xb,
    stride_xc,
    stride_ss,
    stride_sc,
    stride_sk,
    stride_wc,
    stride_wk,
    stride_ob,
    stride_oc,
    KW: tl.constexpr,
    BLOCK_C: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)  # kernels/pdl.py: launched while the kernel before it ends
    # one program: sequence `row`, channels [pc * BLOCK_C, (pc + 1) * BLOCK_C)
    row = tl.program_id(0)
    pc = tl.program_id(1)
    offs = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    mask = offs < C
    slot = tl.load(slot_ptr + row).to(tl.int64)
    s_row = state_ptr + slot * stride_ss + offs * stride_sc
    w_row = w_ptr + offs * stride_wc
    act: tl.constexpr = x_ptr.dtype.element_ty
    wdt: tl.constexpr = w_ptr.dtype.element_ty

    # window = [state columns 0 .. KW-2 rounded to the activation dtype, x], multiplied in the
    # weight's dtype with fp32 sums; the new state is the window shifted left by one. Column j is
    # loaded before column j - 1 is overwritten.
    acc = tl.zeros([BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KW - 1):
        s = _round_to(tl.load(s_row + j * stride_sk, mask=mask, other=0.0), act)
        w = tl.load(w_row + j * stride_wk, mask=mask, other=0.0).to(tl.float32)
        acc += _round_to(s, wdt) * w
        if j > 0:
            tl.store(s_row + (j - 1) * stride_sk, s, mask=mask)
    x = tl.load(x_ptr + row * stride_xb + offs * stride_xc, mask=mask, other=0.0).to(tl.float32)
    w = tl.load(w_row + (KW - 1) * stride_wk, mask=mask, other=0.0).to(tl.float32)
    acc += _round_to(x, wdt) * w
    tl.store(s_row + (KW - 2) * stride_sk, x, mask=mask)

    # conv output in the weight's dtype; SiLU in fp32, rounded to the weight's and then x's dtype
    y = _round_to(acc, wdt)
    y = _round_to(_round_to(y / (1.0 + tl.exp(-y)), wdt), act)
    tl.store(out_ptr + row * stride_ob + offs * stride_oc, y.to(out_ptr.dtype.element_ty), mask=mask)


def causal_conv1d_update(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """One decode step of the depthwise causal conv + SiLU, updating each row's conv window in place.

    x [B, C] (bf16/fp16/fp32; any strides), conv_state [num_slots, C, K - 1] fp32 (any strides),
    weight [C, K] or [C, 1, K] (nn.Conv1d's), slots [B] int64. Returns out [B, C] in x's dtype
    (written into `out` when given): silu(conv over [conv_state[slot] rounded to x's dtype, x]).
    The window is shifted left and x appended, stored as fp32.
    """
    b, c = x.shape
    weight = weight.reshape(weight.shape[0], weight.shape[-1])
    kw = weight.shape[1]
    assert kw >= 2 and conv_state.shape[1:] == (c, kw - 1) and weight.shape[0] == c
    assert conv_state.dtype == torch.float32 and slots.shape == (b,)
    if out is None:
        out = torch.empty((b, c), dtype=x.dtype, device=x.device)
    if b == 0:
        return out
    block_c = min(256, triton.next_power_of_2(c))
    grid = (b, triton.cdiv(c, block_c))
    _causal_conv1d_update_kernel[grid](
        x,
        conv_state,
        weight,
        slots,
        out,
        c,
        x.stride(0),
        x.stride(1),
        conv_state.stride(0),
        conv_state.stride(1),
        conv_state.stride(2),
        weight.stride(0),
        weight.stride(1),
        out.stride(0),
        out.stride(1),
        KW=kw,
        BLOCK_C=block_c,
        PDL=pdl_on(x.device),
        num_warps=4,
        launch_pdl=pdl_on(x.device),
    )
    return out


@triton.jit
def _recurrent_gated_delta_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    g_ptr,
    beta_ptr,
    state_ptr,
    slot_ptr,
    out_ptr,
    scale,
    eps,
    DK: tl.constexpr,
    DV: tl.constexpr,
    stride_qb,
    stride_qh,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vd,
    stride_gb,
    stride_gh,
    stride_bb,
    stride_bh,
    stride_ss,
    stride_sh,
    stride_sk,
    stride_sv,
    stride_ob,
    stride_oh,
    stride_od,
    alog_ptr,
    dt_ptr,
    GROUP: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_V: tl.constexpr,
    RAW_GATES: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)
    # one program: sequence `row`, value head `h`, value columns [pv * BLOCK_V, (pv + 1) * BLOCK_V)
    # of the state, all Dk rows (S^T k and S^T q reduce over Dk)
    row = tl.program_id(0)
    h = tl.program_id(1)
    pv = tl.program_id(2)
    hk = h // GROUP
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = pv * BLOCK_V + tl.arange(0, BLOCK_V)
    mk = offs_k < DK
    mv = offs_v < DV

    q = tl.load(q_ptr + row * stride_qb + hk * stride_qh + offs_k * stride_qd, mask=mk, other=0.0)
    k = tl.load(k_ptr + row * stride_kb + hk * stride_kh + offs_k * stride_kd, mask=mk, other=0.0)
    q = q.to(tl.float32)
    k = k.to(tl.float32)
    q = q * tl.rsqrt(tl.sum(q * q, axis=0) + eps) * scale
    k = k * tl.rsqrt(tl.sum(k * k, axis=0) + eps)
    v = tl.load(v_ptr + row * stride_vb + h * stride_vh + offs_v * stride_vd, mask=mv, other=0.0)
    v = v.to(tl.float32)
    g = tl.load(g_ptr + row * stride_gb + h * stride_gh).to(tl.float32)
    beta = tl.load(beta_ptr + row * stride_bb + h * stride_bh).to(tl.float32)
    if RAW_GATES:  # g, beta are in_proj's raw a, b: the gates as kernels/fused.py's gdn_gates makes them
        x = g + tl.load(dt_ptr + h).to(tl.float32)
        softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
        g = -tl.exp(tl.load(alog_ptr + h).to(tl.float32)) * softplus
        beta = (1.0 / (1.0 + tl.exp(-beta))).to(beta_ptr.dtype.element_ty).to(tl.float32)

    slot = tl.load(slot_ptr + row).to(tl.int64)
    s_ptrs = (
        state_ptr
        + slot * stride_ss
        + h * stride_sh
        + offs_k[:, None] * stride_sk
        + offs_v[None, :] * stride_sv
    )
    m = mk[:, None] & mv[None, :]
    s = tl.load(s_ptrs, mask=m, other=0.0)  # [BLOCK_K, BLOCK_V] fp32
    s = s * tl.exp(g)
    predicted = tl.sum(s * k[:, None], axis=0)  # S^T k: [BLOCK_V]
    delta = (v - predicted) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)  # S^T q
    tl.store(s_ptrs, s, mask=m)
    o_ptrs = out_ptr + row * stride_ob + h * stride_oh + offs_v * stride_od
    o = _round_to(o, out_ptr.dtype.element_ty)  # round to nearest even, in the interpreter too
    tl.store(o_ptrs, o.to(out_ptr.dtype.element_ty), mask=mv)


def fused_recurrent_gated_delta_rule_update(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    state: torch.Tensor,
    slots: torch.Tensor,
    scale: float | None = None,
    out: torch.Tensor | None = None,
    eps: float = 1e-6,
    raw_gates: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One decode step of the gated delta rule, updating each row's recurrent state in place.

    q, k [B, Hk, Dk]; v [B, Hv, Dv]; g [B, Hv] (log decay, fp32); beta [B, Hv]; state
    [num_slots, Hv, Dk, Dv] fp32 (any strides); slots [B] int64; scale defaults to Dk**-0.5. Inputs
    may have any strides. Value head h reads key head h // (Hv // Hk). Per (row, h), with q and k
    L2-normalized (`eps` as in gated_delta.l2norm) and q scaled:

        S = exp(g) * S;   S += k (beta * (v - S^T k))^T;   o = S^T q

    Returns o [B, Hv, Dv] in q's dtype (written into `out` when given); S is stored back in place.
    `raw_gates` = (A_log, dt_bias) [Hv]: g and beta are the raw a and b [B, Hv], and the kernel makes
    the gates itself, as kernels/fused.py's `gdn_gates` does (one launch fewer a layer).
    """
    b, hk, dk = q.shape
    hv, dv = v.shape[1], v.shape[2]
    assert k.shape == q.shape and v.shape[0] == b and hv % hk == 0
    assert g.shape == (b, hv) and beta.shape == (b, hv) and slots.shape == (b,)
    a_log, dt_bias = raw_gates if raw_gates is not None else (g, g)  # (unread without raw gates)
    assert state.shape[1:] == (hv, dk, dv) and state.dtype == torch.float32
    if scale is None:
        scale = dk**-0.5
    if out is None:
        out = torch.empty((b, hv, dv), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    block_k = triton.next_power_of_2(dk)
    # Each program holds a [BLOCK_K, BLOCK_V] fp32 state tile in registers: at Dk = 128, BLOCK_V = 32
    # is 32 values a thread at 4 warps (about 165 registers for sm_90, no spills), and B * Hv * Dv / 32
    # programs (128 for one sequence of Qwen3.5-9B). Measured on an H200 at Qwen3.5-9B shape, batch 32
    # (bench/profile_step.py): 0.91 ms a step over 24 layers, against 1.46 ms at BLOCK_V = 16 and
    # 1.11-1.17 ms at 8 warps with BLOCK_V 32 or 64.
    block_v = min(triton.next_power_of_2(dv), max(8, 4096 // block_k))
    grid = (b, hv, triton.cdiv(dv, block_v))
    _recurrent_gated_delta_kernel[grid](
        q,
        k,
        v,
        g,
        beta,
        state,
        slots,
        out,
        float(scale),
        float(eps),
        dk,
        dv,
        *q.stride(),
        *k.stride(),
        *v.stride(),
        *g.stride(),
        *beta.stride(),
        *state.stride(),
        *out.stride(),
        a_log,
        dt_bias,
        GROUP=hv // hk,
        BLOCK_K=block_k,
        BLOCK_V=block_v,
        RAW_GATES=raw_gates is not None,
        PDL=pdl_on(q.device),
        num_warps=4,
        launch_pdl=pdl_on(q.device),
    )
    return out
