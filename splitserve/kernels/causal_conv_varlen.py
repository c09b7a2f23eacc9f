"""Varlen depthwise causal conv1d + SiLU for the prefill chunks of a step (Qwen3.5's Gated DeltaNet), in
one launch over all chunks, continuing each sequence's conv window from the engine's state pool.

The P prefill chunks lie back to back in the flat batch (rows `cu_seqlens[i] .. cu_seqlens[i + 1]` of
`x`); chunk i's conv window is `conv_state[slots[i]]`, the K - 1 inputs before its first token:

    x           [T, C]                 the chunks' conv inputs (any strides)
    conv_state  [num_slots, C, K - 1]  fp32, `states["conv"][:, layer]` (any strides)
    weight      [C, K]                 depthwise taps (nn.Conv1d's [C, 1, K] reshaped)
    cu_seqlens  [P + 1] int            chunk starts in x, then T
    token_seq   [T] int                each row's chunk index
    slots       [P] int64              each chunk's state slot

Output row t = silu(sum_j w[:, j] * in[t - K + 1 + j]), where `in` before a chunk's first token reads
the conv window. The arithmetic is fp32 with the result rounded as the torch path rounds it (to the
weight's dtype, SiLU, then to x's dtype). `conv1d_varlen_update_states` then writes each chunk's last
K - 1 inputs back into its slot (a second launch: every read of the old windows is done by then). No
host synchronization: both can run inside a captured graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.gated_delta import _round_to

TILE = (16, 128, 4)  # a program's rows, channels and warps: the fastest of bench/conv_varlen_gpu.py's sweep


@triton.jit
def _conv_varlen_kernel(
    x_ptr, state_ptr, w_ptr, cu_ptr, seq_ptr, slot_ptr, out_ptr,
    T, C,
    stride_xt, stride_xc, stride_ss, stride_sc, stride_sk, stride_wc, stride_wk, stride_ot, stride_oc,
    KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # one program: rows [pt * BLOCK_T, +BLOCK_T) x channels [pc * BLOCK_C, +BLOCK_C)
    pt, pc = tl.program_id(0), tl.program_id(1)
    rows = pt * BLOCK_T + tl.arange(0, BLOCK_T)
    chans = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    mr, mc = rows < T, chans < C
    seq = tl.load(seq_ptr + rows, mask=mr, other=0)
    start = tl.load(cu_ptr + seq, mask=mr, other=0).to(tl.int64)  # [BLOCK_T] the chunk's first row
    slot = tl.load(slot_ptr + seq, mask=mr, other=0).to(tl.int64)
    wdt: tl.constexpr = w_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    for j in tl.static_range(KW):
        src = rows.to(tl.int64) - (KW - 1) + j  # [BLOCK_T] input row of tap j
        in_x = src >= start
        mx = (mr & in_x)[:, None] & mc[None, :]
        xv = tl.load(x_ptr + src[:, None] * stride_xt + chans[None, :] * stride_xc, mask=mx, other=0.0)
        col = src - start + (KW - 1)  # the window's column for rows before the chunk
        ms = (mr & ~in_x)[:, None] & mc[None, :]
        sp = state_ptr + slot[:, None] * stride_ss + chans[None, :] * stride_sc + col[:, None] * stride_sk
        sv = _round_to(tl.load(sp, mask=ms, other=0.0), x_ptr.dtype.element_ty)
        v = tl.where(in_x[:, None], xv.to(tl.float32), sv)
        w = tl.load(w_ptr + chans * stride_wc + j * stride_wk, mask=mc, other=0.0).to(tl.float32)
        acc += _round_to(v, wdt) * w[None, :]
    y = _round_to(acc, wdt)
    y = _round_to(_round_to(y / (1.0 + tl.exp(-y)), wdt), out_ptr.dtype.element_ty)
    mo = mr[:, None] & mc[None, :]
    optr = out_ptr + rows[:, None].to(tl.int64) * stride_ot + chans[None, :] * stride_oc
    tl.store(optr, y.to(out_ptr.dtype.element_ty), mask=mo)


@triton.jit
def _conv_states_kernel(
    x_ptr, state_ptr, cu_ptr, slot_ptr, C,
    stride_xt, stride_xc, stride_ss, stride_sc, stride_sk,
    KW: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    # one program: chunk `i`, channels [pc * BLOCK_C, +BLOCK_C); new window column m holds input
    # row end - (K - 1) + m, from x when inside the chunk, else the old window's column m + len.
    # NOTE: column m is written after column m + len (> m) is read, and later m read higher columns
    # only, so the in-place shift never reads a column it already wrote.
    i, pc = tl.program_id(0), tl.program_id(1)
    chans = pc * BLOCK_C + tl.arange(0, BLOCK_C)
    mc = chans < C
    start = tl.load(cu_ptr + i).to(tl.int64)
    end = tl.load(cu_ptr + i + 1).to(tl.int64)
    slot = tl.load(slot_ptr + i).to(tl.int64)
    base = state_ptr + slot * stride_ss + chans * stride_sc
    for m in tl.static_range(KW - 1):
        src = end - (KW - 1) + m
        if src >= start:
            v = tl.load(x_ptr + src * stride_xt + chans * stride_xc, mask=mc, other=0.0).to(tl.float32)
        else:
            old = tl.load(base + (m + end - start) * stride_sk, mask=mc, other=0.0)
            v = _round_to(old, x_ptr.dtype.element_ty)
        tl.store(base + m * stride_sk, v, mask=mc)


def causal_conv1d_varlen(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    token_seq: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor | None = None,
    tile: tuple[int, int, int] | None = None,
) -> torch.Tensor:
    """silu(causal depthwise conv) over every chunk of x [T, C], reading each chunk's conv window;
    -> out [T, C] in x's dtype. The windows are not changed (see `conv1d_varlen_update_states`).
    `tile`: (rows, channels, warps) of a program instead of TILE (bench/conv_varlen_gpu.py sweeps it)."""
    t, c = x.shape
    weight = weight.reshape(weight.shape[0], weight.shape[-1])  # [C, K]
    kw = weight.shape[1]
    assert conv_state.shape[1:] == (c, kw - 1) and conv_state.dtype == torch.float32
    if out is None:
        out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    if t == 0:
        return out
    block_t, block_c, warps = tile or TILE
    block_c = min(block_c, triton.next_power_of_2(c))
    grid = (triton.cdiv(t, block_t), triton.cdiv(c, block_c))
    _conv_varlen_kernel[grid](
        x, conv_state, weight, cu_seqlens, token_seq, slots, out, t, c,
        *x.stride(), *conv_state.stride(), *weight.stride(), *out.stride(),
        KW=kw, BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return out


def conv1d_varlen_update_states(
    x: torch.Tensor, conv_state: torch.Tensor, cu_seqlens: torch.Tensor, slots: torch.Tensor
) -> None:
    """In place: each chunk's conv window := the K - 1 inputs before its end (x [T, C], fp32 stored)."""
    c = x.shape[1]
    kw = conv_state.shape[2] + 1
    n = slots.shape[0]
    if n == 0:
        return
    block_c = min(256, triton.next_power_of_2(c))
    grid = (n, triton.cdiv(c, block_c))
    _conv_states_kernel[grid](
        x, conv_state, cu_seqlens, slots, c, *x.stride(), *conv_state.stride(),
        KW=kw, BLOCK_C=block_c, num_warps=4,
    )  # fmt: skip
