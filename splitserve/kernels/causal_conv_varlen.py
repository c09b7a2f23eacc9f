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

The split variant (q | k | v into three contiguous tensors, what fla's varlen rule reads) can also
L2-normalize each key head of q and k, as fla's `l2norm_fwd` would next (`qk_norm_dim`): a program's
tile then spans exactly one head, so a row's sum of squares is a reduction inside the tile, and the
q and k planes are written once instead of written, read and written again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.gated_delta import _round_to

TILE = (16, 128, 4)  # a program's rows, channels and warps: the fastest of bench/conv_varlen_gpu.py's sweep
L2NORM_EPS = 1e-6  # fla's l2norm_fwd default, as its gated delta rule normalizes q and k
MAX_NORM_DIM = 256  # the widest key head a tile holds for the fused L2 norm


def can_fuse_qk_l2norm(key_dim: int, head_dim: int) -> bool:
    """Whether `causal_conv1d_varlen_split` can L2-normalize q and k per key head of `head_dim` channels:
    a power of two up to MAX_NORM_DIM (a tile's channel block) and key_dim whole heads. A function of
    shapes only, so that a captured CUDA graph and its replays take the same path."""
    return 0 < head_dim <= MAX_NORM_DIM and head_dim & (head_dim - 1) == 0 and key_dim % head_dim == 0


@triton.jit
def _conv_varlen_kernel(
    x_ptr, state_ptr, w_ptr, cu_ptr, seq_ptr, slot_ptr, out_ptr,
    T, C, KD, VD, eps,
    stride_xt, stride_xc, stride_ss, stride_sc, stride_sk, stride_wc, stride_wk, stride_ot, stride_oc,
    KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr, SPLIT: tl.constexpr,
    L2NORM: tl.constexpr,
):  # fmt: skip
    # one program: rows [r0, r0 + BLOCK_T) x channels [c0, c0 + BLOCK_C)
    r0 = tl.program_id(0) * BLOCK_T
    c0 = tl.program_id(1) * BLOCK_C
    dr, dc = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_C)
    rows = r0 + dr
    mr, mc = rows < T, c0 + dc < C
    seq = tl.load(seq_ptr + rows, mask=mr, other=0)
    start = tl.load(cu_ptr + seq, mask=mr, other=0).to(tl.int32)  # [BLOCK_T] the chunk's first row
    pos = rows - start  # each row's place in its chunk
    wdt: tl.constexpr = w_ptr.dtype.element_ty
    # x addressed from the tile's corner with 32-bit offsets: the per-element address arithmetic
    # (not the memory) was what bounded this kernel with 64-bit offsets computed per element
    x_blk = x_ptr + r0.to(tl.int64) * stride_xt + c0.to(tl.int64) * stride_xc
    offs = dr[:, None] * stride_xt + dc[None, :] * stride_xc
    m2 = mr[:, None] & mc[None, :]
    acc = tl.zeros([BLOCK_T, BLOCK_C], dtype=tl.float32)
    if tl.min(tl.where(mr, pos, KW), 0) >= KW - 1:  # every row's taps inside x (all but chunk starts)
        for j in tl.static_range(KW):
            xf = tl.load(x_blk + offs - (KW - 1 - j) * stride_xt, mask=m2, other=0.0).to(tl.float32)
            wf = tl.load(w_ptr + (c0 + dc) * stride_wc + j * stride_wk, mask=mc, other=0.0).to(tl.float32)
            acc += _round_to(xf, wdt) * wf[None, :]
    else:  # some rows read their chunk's conv window (column pos + j for tap j) for the first taps
        slot = tl.load(slot_ptr + seq, mask=mr, other=0).to(tl.int64)
        s_row = state_ptr + slot[:, None] * stride_ss + (c0 + dc)[None, :].to(tl.int64) * stride_sc
        for j in tl.static_range(KW):
            in_x = pos >= KW - 1 - j
            mx = (mr & in_x)[:, None] & mc[None, :]
            xv = tl.load(x_blk + offs - (KW - 1 - j) * stride_xt, mask=mx, other=0.0)
            ms = (mr & ~in_x)[:, None] & mc[None, :]
            sv = tl.load(s_row + (pos + j)[:, None] * stride_sk, mask=ms, other=0.0)
            v = tl.where(in_x[:, None], xv.to(tl.float32), _round_to(sv, x_ptr.dtype.element_ty))
            w = tl.load(w_ptr + (c0 + dc) * stride_wc + j * stride_wk, mask=mc, other=0.0).to(tl.float32)
            acc += _round_to(v, wdt) * w[None, :]
    y = _round_to(acc, wdt)
    y = _round_to(_round_to(y / (1.0 + tl.exp(-y)), wdt), out_ptr.dtype.element_ty)
    if L2NORM:  # SPLIT with BLOCK_C = the key head dim: a q or k tile holds one head of each row
        if c0 < 2 * KD:  # fla's l2norm_fwd on the rounded output (rows past T: 0 * 1 / sqrt(eps))
            rstd = 1 / tl.sqrt(tl.sum(y * y, 1) + eps)
            y = _round_to(y * rstd[:, None], out_ptr.dtype.element_ty)
    if SPLIT:  # planes [q: T x KD | k: T x KD | v: T x VD], each row-major; a tile lies in one plane
        in_k, in_v = (c0 >= KD).to(tl.int32), (c0 >= 2 * KD).to(tl.int32)
        plane = (in_k + in_v) * KD  # the plane's first channel: 0, KD or 2 KD
        width = KD + in_v * (VD - KD)
        o_blk = out_ptr + plane.to(tl.int64) * T + r0.to(tl.int64) * width + (c0 - plane)
        optr = o_blk + dr[:, None] * width + dc[None, :]
    else:
        o_blk = out_ptr + r0.to(tl.int64) * stride_ot + c0.to(tl.int64) * stride_oc
        optr = o_blk + dr[:, None] * stride_ot + dc[None, :] * stride_oc
    tl.store(optr, y.to(out_ptr.dtype.element_ty), mask=m2)


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
    if out is None:
        out = torch.empty((t, c), dtype=x.dtype, device=x.device)
    _launch(x, conv_state, weight, cu_seqlens, token_seq, slots, out, None, tile)
    return out


def causal_conv1d_varlen_split(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    token_seq: torch.Tensor,
    slots: torch.Tensor,
    key_dim: int,
    tile: tuple[int, int, int] | None = None,
    qk_norm_dim: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """`causal_conv1d_varlen` with its output split at the channels' q | k | v boundaries (key_dim,
    key_dim, the rest) into three contiguous tensors [T, key_dim], [T, key_dim], [T, C - 2 key_dim]:
    what fla's varlen rule reads, with no strided copies in between.

    `qk_norm_dim`: the key head dim, to L2-normalize every head of q and k as fla's `l2norm_fwd` does
    (fp32 from the rounded output, eps L2NORM_EPS); `can_fuse_qk_l2norm` must hold. The tile's channel
    block is then the head dim, whatever `tile` says."""
    t, c = x.shape
    buf = torch.empty(t * c, dtype=x.dtype, device=x.device)
    _launch(x, conv_state, weight, cu_seqlens, token_seq, slots, buf, key_dim, tile, qk_norm_dim)
    q, k, v = buf.split([t * key_dim, t * key_dim, t * (c - 2 * key_dim)])
    return q.view(t, key_dim), k.view(t, key_dim), v.view(t, c - 2 * key_dim)


def _launch(
    x: torch.Tensor,
    conv_state: torch.Tensor,
    weight: torch.Tensor,
    cu_seqlens: torch.Tensor,
    token_seq: torch.Tensor,
    slots: torch.Tensor,
    out: torch.Tensor,
    key_dim: int | None,
    tile: tuple[int, int, int] | None,
    norm_dim: int | None = None,
) -> None:
    """One launch of `_conv_varlen_kernel` into out [T, C] (any strides), or with `key_dim` into the
    flat buffer of the q | k | v planes (q and k L2-normalized per head of `norm_dim` channels)."""
    t, c = x.shape
    weight = weight.reshape(weight.shape[0], weight.shape[-1])  # [C, K]
    kw = weight.shape[1]
    assert conv_state.shape[1:] == (c, kw - 1) and conv_state.dtype == torch.float32
    if t == 0:
        return
    block_t, block_c, warps = tile or TILE
    block_c = min(block_c, triton.next_power_of_2(c))
    if key_dim is not None:  # a tile may not straddle two planes
        assert 0 < 2 * key_dim < c
        block_c = min(block_c, key_dim & -key_dim, (c - 2 * key_dim) & -(c - 2 * key_dim))
    if norm_dim is not None:  # one head a tile; v's last tile may run past C (masked)
        assert key_dim is not None and can_fuse_qk_l2norm(key_dim, norm_dim)
        block_c = norm_dim
    grid = (triton.cdiv(t, block_t), triton.cdiv(c, block_c))
    strides = (0, 0) if key_dim is not None else out.stride()
    _conv_varlen_kernel[grid](
        x, conv_state, weight, cu_seqlens, token_seq, slots, out, t, c, key_dim or 0, c - 2 * (key_dim or 0),
        L2NORM_EPS, *x.stride(), *conv_state.stride(), *weight.stride(), *strides,
        KW=kw, BLOCK_T=block_t, BLOCK_C=block_c, SPLIT=key_dim is not None, L2NORM=norm_dim is not None,
        num_warps=warps,
    )  # fmt: skip


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
