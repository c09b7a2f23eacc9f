"""Paged attention in Triton: decode (split-K over the context) and variable-length chunked prefill.

Both read K/V straight from the engine's block-major cache through block tables, with no gather
into contiguous copies. A layer's K (or V) cache is the strided view

    kv[:, layer, 0]   [num_blocks, block_size, KVH, D]     (kv[:, layer, 1] for V: same strides)

Decode (one query token per sequence). A program takes one sequence, one KV head and one split of
the context: the G query heads that share the KV head are the rows of one tensor-core tile (padded
to 16), so each K/V tile is loaded once for all of them. With `num_splits` > 1 each split writes a
partial result and its log-sum-exp, and a second small kernel merges the splits (flash-decoding):
at batch 1 there are only KVH programs per split, too few to keep an H200's 132 SMs reading.

Prefill. A program takes one query tile of one prefill chunk for one query head and walks the keys
from the sequence's first token to the tile's last position (the chunk's own keys, just stored,
and every earlier chunk's), causally masked: chunked prefill and prefix-cache hits are the same
case. All chunks of a step are one launch.

Everything is sized by tensors (context lengths, block tables), never by host-side values that
change per step, so the decode kernels can be captured in CUDA graphs. fp32 inputs use IEEE
products (no TF32), so fp32 results track the plain-torch reference to rounding.

Checked on CPU with `TRITON_INTERPRET=1` (tests/kernels); `triton` is imported lazily by callers.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from splitserve.kernels.pdl import EARLY as pdl_early
from splitserve.kernels.pdl import begin, begin_early, end_early
from splitserve.kernels.pdl import on as pdl_on

_LOG2E = 1.4426950408889634


@triton.jit
def _kv_rows(table_ptr, offs, valid, kvh, stride_kb, stride_kt, stride_kh, BS: tl.constexpr):
    """Offsets into a layer's K (or V) cache of the tokens `offs` of one sequence's KV head `kvh`."""
    block = tl.load(table_ptr + offs // BS, mask=valid, other=0).to(tl.int64)
    return block * stride_kb + (offs % BS) * stride_kt + kvh * stride_kh


@triton.jit
def _softmax_step(q, k, m_i, l_i, offs, hi, pos, scale_log2, CAUSAL: tl.constexpr, PRECISION: tl.constexpr):
    """The online softmax's step over keys `k` [BLOCK_N, D] at positions `offs` (those past `hi`
    masked; CAUSAL: row i also masks keys past its position pos[i]) -> (m_new, l_new, p, alpha):
    the new running max and sum, the tile's probabilities and the old accumulator's rescale."""
    valid = offs < hi
    s = tl.dot(q, tl.trans(k), input_precision=PRECISION) * scale_log2  # [rows, BLOCK_N], log2 units
    if CAUSAL:
        keep = (offs[None, :] <= pos[:, None]) & valid[None, :]
    else:
        keep = valid[None, :]
    s = tl.where(keep, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    return m_new, l_i * alpha + tl.sum(p, 1), p, alpha


@triton.jit
def _attend_block(
    q, m_i, l_i, acc, k_ptr, v_ptr, table_ptr, n0, hi, pos, kvh, scale_log2,
    stride_kb, stride_kt, stride_kh,
    D: tl.constexpr, BS: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    """One online-softmax step over the cached keys [n0, n0 + BLOCK_N) below `hi` of one sequence
    (block table row `table_ptr`, KV head `kvh`): -> the updated (m_i, l_i, acc) of q's rows.
    CAUSAL: row i also masks keys past its position pos[i]."""
    offs = n0 + tl.arange(0, BLOCK_N)
    valid = offs < hi
    d = tl.arange(0, D)
    rows = _kv_rows(table_ptr, offs, valid, kvh, stride_kb, stride_kt, stride_kh, BS)
    k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    m_i, l_i, p, alpha = _softmax_step(q, k, m_i, l_i, offs, hi, pos, scale_log2, CAUSAL, PRECISION)
    v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=valid[:, None], other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    return m_i, l_i, acc


@triton.jit
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    tables_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    scale_log2,
    stride_qb,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_tb,
    stride_ob,
    stride_oh,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr,
    EARLY: tl.constexpr,
    FRESH: tl.constexpr,
):
    begin_early(PDL, EARLY)
    seq = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    ctx = tl.load(lens_ptr + seq).to(tl.int32)
    per_split = tl.cdiv(tl.cdiv(ctx, NUM_SPLITS), BLOCK_N) * BLOCK_N
    start = split * per_split
    end = tl.minimum(start + per_split, ctx)
    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D)
    table = tables_ptr + seq * stride_tb

    # The split's first tile is read before the wait for the previous kernel (kernels/pdl.py): no
    # kernel of this step writes the block tables, the context lengths or the keys and values of
    # earlier tokens. The step's own token, at ctx - 1, is stored by an earlier kernel of the step
    # (fused.py's qk_norm_rope_store, or the plain path's store): its row is read after the wait. A
    # verify chunk's rows (spec/rows.py, verify_graphs.py) also attend to the chunk's earlier tokens,
    # stored by the same kernel: the last FRESH positions (a bound on those) are read after the wait.
    offs = start + tl.arange(0, BLOCK_N)
    rows = _kv_rows(table, offs, offs < end, kvh, stride_kb, stride_kt, stride_kh, BS)
    early = (offs < tl.minimum(end, ctx - FRESH))[:, None]
    k = tl.load(k_ptr + rows[:, None] + d[None, :], mask=early, other=0.0)
    v = tl.load(v_ptr + rows[:, None] + d[None, :], mask=early, other=0.0)
    if FRESH == 1:
        new = ctx - 1  # the step's token
        new_d = new + 0 * d  # [D]: a mask of the row's width (the interpreter takes no scalar & vector)
        new_here = (new_d >= start) & (new_d < start + BLOCK_N) & (new_d < end)
        new_block = tl.load(table + new // BS).to(tl.int64)  # (always in the table: new < ctx)
        new_row = new_block * stride_kb + (new % BS) * stride_kt + kvh * stride_kh
        end_early(PDL, EARLY)
        at_new = (offs == new)[:, None]
        k = tl.where(at_new, tl.load(k_ptr + new_row + d, mask=new_here, other=0.0)[None, :], k)
        v = tl.where(at_new, tl.load(v_ptr + new_row + d, mask=new_here, other=0.0)[None, :], v)
    else:
        end_early(PDL, EARLY)
        late = ((offs >= ctx - FRESH) & (offs < end))[:, None]
        k = tl.where(late, tl.load(k_ptr + rows[:, None] + d[None, :], mask=late, other=0.0), k)
        v = tl.where(late, tl.load(v_ptr + rows[:, None] + d[None, :], mask=late, other=0.0), v)

    head = kvh * G + g
    q = tl.load(q_ptr + seq * stride_qb + head[:, None] * stride_qh + d[None, :], mask=(g < G)[:, None])
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D], tl.float32)
    if start < end:  # (not causal: `g` stands in for the unused positions)
        m_i, l_i, p, alpha = _softmax_step(q, k, m_i, l_i, offs, end, g, scale_log2, False, PRECISION)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PRECISION)
    for n0 in range(start + BLOCK_N, end, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_ptr, v_ptr, table, n0, end, g, kvh, scale_log2,
            stride_kb, stride_kt, stride_kh, D, BS, BLOCK_N, False, PRECISION,
        )  # fmt: skip

    out_mask = (g < G)[:, None]
    if NUM_SPLITS == 1:
        acc = acc / l_i[:, None]
        o = out_ptr + seq * stride_ob + head[:, None] * stride_oh + d[None, :]
        tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=out_mask)
    else:
        # partials [B, H, NUM_SPLITS, D] fp32 and lse [B, H, NUM_SPLITS] (log2 units), contiguous
        nonempty = l_i > 0
        acc = acc / tl.where(nonempty, l_i, 1.0)[:, None]
        lse = tl.where(nonempty, m_i + tl.log2(tl.where(nonempty, l_i, 1.0)), float("-inf"))
        num_heads = tl.num_programs(1) * G
        row = (seq * num_heads + head) * NUM_SPLITS + split
        tl.store(part_ptr + row[:, None] * D + d[None, :], acc, mask=out_mask)
        tl.store(lse_ptr + row, lse, mask=g < G)


@triton.jit
def _decode_merge_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    stride_ob,
    stride_oh,
    H: tl.constexpr,
    D: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    S_PAD: tl.constexpr,
    PDL: tl.constexpr,
):
    begin(PDL)
    seq = tl.program_id(0)
    head = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.arange(0, D)
    row = (seq * H + head) * NUM_SPLITS + s
    lse = tl.load(lse_ptr + row, mask=s < NUM_SPLITS, other=float("-inf"))
    m = tl.max(lse, 0)
    w = tl.exp2(lse - m)  # empty splits: exp2(-inf) = 0
    parts = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=(s < NUM_SPLITS)[:, None], other=0.0)
    out = tl.sum(parts * w[:, None], 0) / tl.sum(w, 0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + d, out.to(out_ptr.dtype.element_ty))


@triton.jit
def _prefill_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    tables_ptr,
    q_start_ptr,
    q_len_ptr,
    ctx_len_ptr,
    scale_log2,
    stride_qt,
    stride_qh,
    stride_kb,
    stride_kt,
    stride_kh,
    stride_tb,
    stride_ot,
    stride_oh,
    G: tl.constexpr,
    D: tl.constexpr,
    BS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PRECISION: tl.constexpr,
):
    chunk = tl.program_id(0)
    tile = tl.num_programs(1) - 1 - tl.program_id(1)  # the longest tiles first: a shorter tail
    head = tl.program_id(2)
    q_len = tl.load(q_len_ptr + chunk).to(tl.int32)
    q0 = tl.load(q_start_ptr + chunk).to(tl.int32)
    ctx = tl.load(ctx_len_ptr + chunk).to(tl.int32)
    prefix = ctx - q_len
    kvh = head // G

    m = tile * BLOCK_M + tl.arange(0, BLOCK_M)
    m_valid = m < q_len
    pos = prefix + m  # each query's position in its sequence: it sees keys 0..pos
    d = tl.arange(0, D)
    q = tl.load(q_ptr + (q0 + m)[:, None] * stride_qt + head * stride_qh + d[None, :], mask=m_valid[:, None])
    # keys up to the tile's last position; none for a tile past the chunk's end (its stores are masked)
    hi = tl.where(tile * BLOCK_M < q_len, tl.minimum(ctx, prefix + (tile + 1) * BLOCK_M), 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    # the key blocks below the tile's first position are seen whole by every row: no causal mask there
    full = tl.minimum(hi, (prefix + tile * BLOCK_M + 1) // BLOCK_N * BLOCK_N)
    table = tables_ptr + chunk * stride_tb
    for n0 in range(0, full, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_ptr, v_ptr, table, n0, hi, pos, kvh, scale_log2,
            stride_kb, stride_kt, stride_kh, D, BS, BLOCK_N, False, PRECISION,
        )  # fmt: skip
    for n0 in range(full, hi, BLOCK_N):
        m_i, l_i, acc = _attend_block(
            q, m_i, l_i, acc, k_ptr, v_ptr, table, n0, hi, pos, kvh, scale_log2,
            stride_kb, stride_kt, stride_kh, D, BS, BLOCK_N, True, PRECISION,
        )  # fmt: skip
    acc = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    o = out_ptr + (q0 + m)[:, None] * stride_ot + head * stride_oh + d[None, :]
    tl.store(o, acc.to(out_ptr.dtype.element_ty), mask=m_valid[:, None])


def _precision(dtype: torch.dtype) -> str:
    return "ieee" if dtype == torch.float32 else "tf32"


def _interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"


def decode_num_splits(batch: int, num_kv_heads: int, max_context: int, sm_count: int = 132) -> int:
    """Splits of the context per (sequence, KV head): enough programs for ~2 waves over the SMs,
    at least 128 tokens per split, at most 16 splits."""
    programs = max(1, batch * num_kv_heads)
    want = -(-2 * sm_count // programs)
    return max(1, min(16, want, max(1, max_context // 128)))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (a strided view)
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int
    context_lens: torch.Tensor,  # [B] int, >= 1
    scale: float,
    num_splits: int = 1,
    out: torch.Tensor | None = None,
    fresh: int = 1,
) -> torch.Tensor:
    """softmax(q K^T * scale) V per sequence over its first context_lens[b] cached tokens -> [B, H, D].
    `fresh`: at most this many of a row's last tokens were stored by the kernel before (1: its own;
    more for a verify chunk's rows), so they are read after the PDL wait."""
    b, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    g = h // kvh
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    out = torch.empty_like(q) if out is None else out
    if b == 0:
        return out
    small = _interpreted()
    block_n = 16 if small else (64 if d <= 128 else 32)
    pdl = pdl_on(q.device)
    if num_splits > 1:
        part = torch.empty((b, h, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((b, h, num_splits), dtype=torch.float32, device=q.device)
    else:
        part = lse = out  # unused
    _decode_split_kernel[(b, kvh, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens, out, part, lse,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d, BS=bs, BLOCK_N=block_n,
        NUM_SPLITS=num_splits, PRECISION=_precision(q.dtype),
        num_warps=4, num_stages=2, PDL=pdl, EARLY=pdl_early, FRESH=triton.next_power_of_2(fresh),
        launch_pdl=pdl,
    )  # fmt: skip
    if num_splits > 1:
        _decode_merge_kernel[(b, h)](
            part, lse, out, out.stride(0), out.stride(1),
            H=h, D=d, NUM_SPLITS=num_splits, S_PAD=max(2, triton.next_power_of_2(num_splits)),
            num_warps=2, PDL=pdl, launch_pdl=pdl,
        )  # fmt: skip
    return out


def paged_prefill_attention(
    q: torch.Tensor,  # [T, H, D] (the prefill rows of the flat batch are addressed by q_start)
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,  # [T, H, D]
    block_tables: torch.Tensor,  # [P, max_blocks] int
    q_start: torch.Tensor,  # [P] int: each chunk's first row in q / out
    q_len: torch.Tensor,  # [P] int
    ctx_len: torch.Tensor,  # [P] int: tokens cached after the chunk (earlier ones + the chunk)
    max_q_len: int,
    scale: float,
    tile: tuple[int, int, int, int] | None = None,
) -> torch.Tensor:
    """Causal attention of each prefill chunk's queries over its sequence's cached keys (incl. its own).
    `tile`: (BLOCK_M, BLOCK_N, warps, stages) instead of the head size's default (bench sweeps)."""
    p = q_len.shape[0]
    _, h, d = q.shape
    _, bs, kvh, _ = k_cache.shape
    assert k_cache.stride() == v_cache.stride() and k_cache.stride(-1) == 1 and q.stride(-1) == 1
    if p == 0:
        return out
    if tile is not None:
        block_m, block_n, warps, stages = tile
    elif _interpreted():
        block_m, block_n, warps, stages = 16, 16, 4, 1
    elif d <= 128:
        block_m, block_n, warps, stages = 128, 64, 8, 3
    else:  # 256 (Qwen3.5): 1.8x the 64-row tile at 4,096 tokens on an H100 (bench/prefill_attention_gpu.py)
        block_m, block_n, warps, stages = 128, 64, 8, 2
    grid = (p, triton.cdiv(max_q_len, block_m), h)
    _prefill_kernel[grid](
        q, k_cache, v_cache, out, block_tables, q_start, q_len, ctx_len,
        scale * _LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        G=h // kvh, D=d, BS=bs, BLOCK_M=block_m, BLOCK_N=block_n, PRECISION=_precision(q.dtype),
        num_warps=warps, num_stages=stages,
    )  # fmt: skip
    return out
