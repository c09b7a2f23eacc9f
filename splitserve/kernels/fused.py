"""Fused Triton kernels for the dense decoder's small per-layer steps on CUDA.

Each replaces a run of tiny torch kernels (about 50 per layer unfused, which at batch 1 cost as much
GPU time as reading the weights) and reproduces torch's bf16 roundings step by step, so the fused
model computes what the plain one does:

* `rmsnorm` (with a residual add): (residual += x, then) `w * round(norm_fp32(residual))`, as HF's
  RMSNorm (statistics in fp32, the product in the activation dtype), or Qwen3.5's zero-centred
  `round(norm_fp32(residual) * (1 + w))`;
* `qk_norm_rope_store`: from the fused QKV projection, per head: optional RMSNorm (Qwen3's q/k
  norm), neox rotary embedding with the cos/sin tables rounded to the activation dtype, then q to
  `q_out`, and k and v straight into the paged KV cache at each token's slot;
* `silu_mul`: `round(silu(gate)) * up`;
* `gated_rmsnorm`: Qwen3.5's `w * norm(x) * silu(z)` per head;
* `sigmoid_gate_mul`: Qwen3.5's attention output times `round(sigmoid(gate))`, the gate read in place.

`ROUND` below rounds an fp32 value to the activation dtype and back: what an op in that dtype does.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from splitserve.kernels.pdl import EARLY as pdl_early
from splitserve.kernels.pdl import begin, begin_early, end_early
from splitserve.kernels.pdl import on as pdl_on


@triton.jit
def _round(x, DTYPE: tl.constexpr):
    return x.to(DTYPE).to(tl.float32)


@triton.jit
def _rmsnorm_kernel(
    x_ptr, res_ptr, w_ptr, out_ptr, stride_x, stride_r, stride_o, n, eps,
    HAS_RES: tl.constexpr, ZERO_CENTRED: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr,
    PDL: tl.constexpr,
):  # fmt: skip
    begin(PDL)
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RES:
        x = _round(x + tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32), DTYPE)
        tl.store(res_ptr + row * stride_r + cols, x.to(DTYPE), mask=mask)
    var = tl.sum(x * x, 0) / n
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTRED:  # Qwen3.5: norm(x) * (1 + w), all in fp32, rounded once
        out = x * tl.rsqrt(var + eps) * (1.0 + w)
    else:
        out = w * _round(x * tl.rsqrt(var + eps), DTYPE)
    tl.store(out_ptr + row * stride_o + cols, out.to(DTYPE), mask=mask)


@triton.jit
def _head_weight(is_q, qw_ptr, kw_ptr, offs):
    """The q norm's weight at `offs` for a query head, else the k norm's, as fp32."""
    if is_q:
        w = tl.load(qw_ptr + offs).to(tl.float32)
    else:
        w = tl.load(kw_ptr + offs).to(tl.float32)
    return w


@triton.jit
def _cos_sin(cos_ptr, sin_ptr, pos, stride_cos, half, DTYPE: tl.constexpr):
    """cos and sin at position `pos` for the rotary halves' lanes `half`, rounded to the activation
    dtype (the table's two halves are equal)."""
    c = _round(tl.load(cos_ptr + pos * stride_cos + half), DTYPE)
    s = _round(tl.load(sin_ptr + pos * stride_cos + half), DTYPE)
    return c, s


@triton.jit
def _rotate(x1, x2, c, s, DTYPE: tl.constexpr):
    """Neox rotary of a head's halves x1, x2 by `_cos_sin`'s c, s, with torch's bf16 roundings:
    rotate_half(x) = [-x2, x1]; out = round(round(x * cos) + round(rotate_half(x) * sin))."""
    o1 = _round(_round(x1 * c, DTYPE) + _round(-x2 * s, DTYPE), DTYPE)
    o2 = _round(_round(x2 * c, DTYPE) + _round(x1 * s, DTYPE), DTYPE)
    return o1, o2


@triton.jit
def _qk_norm_rope_store_kernel(
    qkv_ptr, q_out_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
    stride_t, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_cos,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, BS: tl.constexpr,
    HAS_NORM: tl.constexpr, DTYPE: tl.constexpr, PDL: tl.constexpr, EARLY: tl.constexpr,
):  # fmt: skip
    begin_early(PDL, EARLY)  # kernels/pdl.py: what no kernel of the step writes is read before the wait
    t = tl.program_id(0)
    head = tl.program_id(1)  # 0..H-1: query heads; H..H+KVH-1: key heads (and their value heads)
    half = tl.arange(0, D // 2)
    is_q = head < H
    c, s = _cos_sin(cos_ptr, sin_ptr, tl.load(pos_ptr + t), stride_cos, half, DTYPE)
    if HAS_NORM:
        w1 = _head_weight(is_q, qw_ptr, kw_ptr, half)
        w2 = _head_weight(is_q, qw_ptr, kw_ptr, D // 2 + half)
    slot = tl.load(slots_ptr + t)
    end_early(PDL, EARLY)
    base = qkv_ptr + t * stride_t + head * D
    x1 = tl.load(base + half).to(tl.float32)
    x2 = tl.load(base + D // 2 + half).to(tl.float32)
    if HAS_NORM:
        var = (tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D
        r = tl.rsqrt(var + eps)
        x1 = _round(w1 * _round(x1 * r, DTYPE), DTYPE)
        x2 = _round(w2 * _round(x2 * r, DTYPE), DTYPE)
    o1, o2 = _rotate(x1, x2, c, s, DTYPE)
    if is_q:
        q = q_out_ptr + t * stride_qt + head * stride_qh
        tl.store(q + half, o1.to(DTYPE))
        tl.store(q + D // 2 + half, o2.to(DTYPE))
    else:
        j = head - H
        dst = (slot // BS) * stride_kb + (slot % BS) * stride_kt + j * stride_kh
        tl.store(k_ptr + dst + half, o1.to(DTYPE))
        tl.store(k_ptr + dst + D // 2 + half, o2.to(DTYPE))
        v = qkv_ptr + t * stride_t + (H + KVH + j) * D
        tl.store(v_ptr + dst + half, tl.load(v + half))
        tl.store(v_ptr + dst + D // 2 + half, tl.load(v + D // 2 + half))


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n, BLOCK: tl.constexpr, DTYPE: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n
    g = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(x_ptr + row * stride_x + n + cols, mask=mask, other=0.0).to(tl.float32)
    silu = _round(g / (1.0 + tl.exp(-g)), DTYPE)
    tl.store(out_ptr + row * stride_o + cols, (silu * u).to(DTYPE), mask=mask)


@triton.jit
def _gated_rmsnorm_kernel(
    x_ptr, z_ptr, w_ptr, out_ptr, stride_xt, stride_zt, stride_ot, eps, rows,
    HEADS: tl.constexpr, D: tl.constexpr, ROWS: tl.constexpr, DTYPE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    begin(PDL)
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)  # ROWS (token t, head h) rows, each normed alone
    t = (r // HEADS).to(tl.int64)
    h = r % HEADS
    d = tl.arange(0, D)
    m = (r < rows)[:, None]
    col = h[:, None] * D + d[None, :]
    x = tl.load(x_ptr + t[:, None] * stride_xt + col, mask=m, other=0.0).to(tl.float32)
    var = tl.sum(x * x, 1) / D
    w = tl.load(w_ptr + d).to(tl.float32)
    normed = _round(w[None, :] * _round(x * tl.rsqrt(var + eps)[:, None], DTYPE), DTYPE)
    z = tl.load(z_ptr + t[:, None] * stride_zt + col, mask=m, other=0.0).to(tl.float32)
    out = normed * (z / (1.0 + tl.exp(-z)))
    tl.store(out_ptr + t[:, None] * stride_ot + col, out.to(DTYPE), mask=m)


@triton.jit
def _gdn_gates_kernel(
    a_ptr, b_ptr, alog_ptr, dt_ptr, g_ptr, beta_ptr, stride_a, stride_b, HV: tl.constexpr,
    BLOCK: tl.constexpr, DTYPE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    begin(PDL)
    t = tl.program_id(0)
    h = tl.arange(0, BLOCK)
    m = h < HV
    a = tl.load(a_ptr + t * stride_a + h, mask=m, other=0.0).to(tl.float32)
    dt = tl.load(dt_ptr + h, mask=m, other=0.0).to(tl.float32)
    x = a + dt
    softplus = tl.where(x > 20.0, x, tl.log(1.0 + tl.exp(tl.minimum(x, 20.0))))
    g = -tl.exp(tl.load(alog_ptr + h, mask=m, other=0.0).to(tl.float32)) * softplus
    tl.store(g_ptr + t * HV + h, g, mask=m)
    b = tl.load(b_ptr + t * stride_b + h, mask=m, other=0.0).to(tl.float32)
    tl.store(beta_ptr + t * HV + h, (1.0 / (1.0 + tl.exp(-b))).to(DTYPE), mask=m)


@triton.jit
def _gated_qk_norm_rope_store_kernel(
    qkv_ptr, q_out_ptr, k_ptr, v_ptr, slots_ptr, pos_ptr, cos_ptr, sin_ptr, qw_ptr, kw_ptr, eps,
    stride_t, stride_qt, stride_qh, stride_kb, stride_kt, stride_kh, stride_cos,
    H: tl.constexpr, KVH: tl.constexpr, D: tl.constexpr, ROT: tl.constexpr, BS: tl.constexpr,
    DTYPE: tl.constexpr,
):  # fmt: skip
    """Qwen3.5's gated attention: rows [q_0 | gate_0 | q_1 | gate_1 ... | k | v]; zero-centred q/k
    norm over D, rotary on the first ROT dims only."""
    t = tl.program_id(0)
    head = tl.program_id(1)
    is_q = head < H
    j = head - H
    src = qkv_ptr + t * stride_t + tl.where(is_q, head * 2 * D, 2 * H * D + j * D)
    d = tl.arange(0, D)
    x = tl.load(src + d).to(tl.float32)
    r = tl.rsqrt(tl.sum(x * x, 0) / D + eps)
    y = _round(x * r * (1.0 + _head_weight(is_q, qw_ptr, kw_ptr, d)), DTYPE)  # the norm's output
    half = tl.arange(0, ROT // 2)
    x1 = tl.load(src + half).to(tl.float32)
    x2 = tl.load(src + ROT // 2 + half).to(tl.float32)
    x1 = _round(x1 * r * (1.0 + _head_weight(is_q, qw_ptr, kw_ptr, half)), DTYPE)
    x2 = _round(x2 * r * (1.0 + _head_weight(is_q, qw_ptr, kw_ptr, ROT // 2 + half)), DTYPE)
    c, s = _cos_sin(cos_ptr, sin_ptr, tl.load(pos_ptr + t), stride_cos, half, DTYPE)
    o1, o2 = _rotate(x1, x2, c, s, DTYPE)
    if is_q:
        dst = q_out_ptr + t * stride_qt + head * stride_qh
        tl.store(dst + d, y.to(DTYPE), mask=d >= ROT)
        tl.store(dst + half, o1.to(DTYPE))
        tl.store(dst + ROT // 2 + half, o2.to(DTYPE))
    else:
        slot = tl.load(slots_ptr + t)
        off = (slot // BS) * stride_kb + (slot % BS) * stride_kt + j * stride_kh
        tl.store(k_ptr + off + d, y.to(DTYPE), mask=d >= ROT)
        tl.store(k_ptr + off + half, o1.to(DTYPE))
        tl.store(k_ptr + off + ROT // 2 + half, o2.to(DTYPE))
        v = tl.load(qkv_ptr + t * stride_t + 2 * H * D + KVH * D + j * D + d)
        tl.store(v_ptr + off + d, v)


@triton.jit
def _sigmoid_gate_kernel(
    x_ptr, qkv_ptr, out_ptr, stride_x, stride_q, stride_o, n,
    D: tl.constexpr, BLOCK: tl.constexpr, DTYPE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    begin(PDL)
    t = tl.program_id(0)
    e = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)  # element of the row [H * D]: head e // D
    m = e < n
    x = tl.load(x_ptr + t * stride_x + e, mask=m, other=0.0).to(tl.float32)
    g = tl.load(qkv_ptr + t * stride_q + (e // D) * 2 * D + D + e % D, mask=m, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_o + e, (x * _round(1.0 / (1.0 + tl.exp(-g)), DTYPE)).to(DTYPE), mask=m)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


def rmsnorm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    zero_centred: bool = False,
) -> torch.Tensor:
    """norm(x) * weight, or with `residual`: residual += x (in place), then norm(residual) * weight.
    `zero_centred`: the weight is stored as an offset from 1 (`ZeroCentredRMSNorm`)."""
    t, n = x.shape
    out = torch.empty_like(x)
    res = residual if residual is not None else x
    pdl = pdl_on(x.device)
    _rmsnorm_kernel[(t,)](
        x, res, weight, out, x.stride(0), res.stride(0), out.stride(0), n, eps,
        HAS_RES=residual is not None, ZERO_CENTRED=zero_centred, BLOCK=triton.next_power_of_2(n),
        DTYPE=_TL[x.dtype], num_warps=8, PDL=pdl, launch_pdl=pdl,
    )  # fmt: skip
    return out


def qk_norm_rope_store(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_positions, D] fp32
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D] (strided view)
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T]
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> torch.Tensor:
    """-> q [T, H, D] (normed, rotated); k (normed, rotated) and v written into the cache at `slots`."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    assert qkv.stride(1) == 1 and k_cache.stride() == v_cache.stride() and cos.stride(1) == 1
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t == 0:
        return q
    norm = q_weight is not None and k_weight is not None
    pdl = pdl_on(qkv.device)
    _qk_norm_rope_store_kernel[(t, num_heads + num_kv_heads)](
        qkv, q, k_cache, v_cache, slots, positions, cos, sin,
        q_weight if norm else qkv, k_weight if norm else qkv, eps,
        qkv.stride(0), q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0),
        H=num_heads, KVH=num_kv_heads, D=d, BS=k_cache.shape[1], HAS_NORM=norm, DTYPE=_TL[qkv.dtype],
        num_warps=1, PDL=pdl, EARLY=pdl_early, launch_pdl=pdl,
    )  # fmt: skip
    return q


GATED_NORM_MULTI_ROW = 8192  # (token, head) rows from which `gated_rmsnorm` gives a program 16 of them


def gated_rmsnorm(x: torch.Tensor, z: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`GatedRMSNorm` per head: x [T, H * D] (rows contiguous), gate z [T, H * D] (any row stride)
    -> round(round(w * round(norm(x))) * silu(z_fp32)), [T, H * D]. D = weight's length."""
    t, n = x.shape
    d = weight.shape[0]
    assert x.stride(1) == 1 and z.stride(1) == 1 and n % d == 0
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    if t:
        rows = t * (n // d)
        # a (token, head) row a program while that fills the GPU (decode); many rows a program in a
        # long prefill, where one-row programs made the kernel wait on memory latency, not bandwidth
        per, warps = (1, 1) if rows < GATED_NORM_MULTI_ROW else (16, 4)
        _gated_rmsnorm_kernel[(triton.cdiv(rows, per),)](
            x, z, weight, out, x.stride(0), z.stride(0), out.stride(0), eps, rows,
            HEADS=n // d, D=d, ROWS=per, DTYPE=_TL[x.dtype], PDL=pdl_on(x.device), num_warps=warps,
            launch_pdl=pdl_on(x.device),
        )  # fmt: skip
    return out


def gdn_gates(
    a: torch.Tensor, b: torch.Tensor, a_log: torch.Tensor, dt_bias: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated DeltaNet's gates from a, b [T, Hv] (any row stride): g = -exp(A_log) * softplus(a +
    dt_bias) (fp32) and beta = sigmoid(b) (b's dtype)."""
    t, hv = a.shape
    g = torch.empty((t, hv), dtype=torch.float32, device=a.device)
    beta = torch.empty((t, hv), dtype=b.dtype, device=b.device)
    if t:
        _gdn_gates_kernel[(t,)](
            a, b, a_log, dt_bias, g, beta, a.stride(0), b.stride(0), HV=hv,
            BLOCK=triton.next_power_of_2(hv), DTYPE=_TL[b.dtype], PDL=pdl_on(a.device), num_warps=1,
            launch_pdl=pdl_on(a.device),
        )  # fmt: skip
    return g, beta


def gated_qk_norm_rope_store(
    qkv: torch.Tensor,  # [T, 2 H D + 2 KVH D]: per head [query | gate], then k, then v
    num_heads: int,
    num_kv_heads: int,
    rotary_dim: int,
    positions: torch.Tensor,
    cos: torch.Tensor,  # [max_positions, rotary_dim] fp32
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slots: torch.Tensor,
    q_weight: torch.Tensor,
    k_weight: torch.Tensor,
    eps: float,
) -> torch.Tensor:
    """Qwen3.5 gated attention's q/k path: zero-centred norm, partial rotary; -> q [T, H, D]; k and
    v stored in the cache at `slots`."""
    t = qkv.shape[0]
    d = k_cache.shape[-1]
    assert qkv.stride(1) == 1 and k_cache.stride() == v_cache.stride() and cos.stride(1) == 1
    q = torch.empty((t, num_heads, d), dtype=qkv.dtype, device=qkv.device)
    if t:
        _gated_qk_norm_rope_store_kernel[(t, num_heads + num_kv_heads)](
            qkv, q, k_cache, v_cache, slots, positions, cos, sin, q_weight, k_weight, eps,
            qkv.stride(0), q.stride(0), q.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), cos.stride(0),
            H=num_heads, KVH=num_kv_heads, D=d, ROT=rotary_dim, BS=k_cache.shape[1], DTYPE=_TL[qkv.dtype],
            num_warps=2,
        )  # fmt: skip
    return q


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 I] = [gate | up] -> silu(gate) * up [T, I]."""
    t, n2 = x.shape
    n = n2 // 2
    out = torch.empty((t, n), dtype=x.dtype, device=x.device)
    block = 1024
    _silu_mul_kernel[(t, triton.cdiv(n, block))](
        x, out, x.stride(0), out.stride(0), n, BLOCK=block, DTYPE=_TL[x.dtype], num_warps=4
    )
    return out


def sigmoid_gate_mul(x: torch.Tensor, qkv: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
    """Qwen3.5 gated attention's output gate: x [T, H * D] * round(sigmoid(gate)), the gate of head h
    read in place from qkv's row [q_0 | gate_0 | q_1 | gate_1 ...] (its columns (2h + 1) D ..)."""
    t, n = x.shape
    assert n == num_heads * head_dim and x.stride(1) == 1 and qkv.stride(1) == 1
    out = torch.empty_like(x)
    if t:
        block = min(1024, triton.next_power_of_2(n))
        pdl = pdl_on(x.device)
        _sigmoid_gate_kernel[(t, triton.cdiv(n, block))](
            x, qkv, out, x.stride(0), qkv.stride(0), out.stride(0), n,
            D=head_dim, BLOCK=block, DTYPE=_TL[x.dtype], PDL=pdl, num_warps=4, launch_pdl=pdl,
        )  # fmt: skip
    return out
