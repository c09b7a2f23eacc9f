"""One token's linear layer (M = 1) as a Triton GEMV that streams the weight at the memory's speed.

Batch-1 decode is the time to read every weight once, and cuBLAS's kernels for M = 1 read the wide
projections (gate/up, the LM head) at about the copy bandwidth but the narrower ones (fused QKV,
o_proj, down_proj: 4,096-6,144 outputs) at 64-79% of it (`bench/gemv.py`, replayed from CUDA graphs
on an H200): too few output tiles to fill the GPU without a split over K and its extra reduction.
Here each program owns BLOCK_N output rows and walks the whole K for them: N / BLOCK_N programs (256
for 4,096 rows of 16), each streaming contiguous rows of the weight into an fp32 accumulator tile
[BLOCK_N, BLOCK_K] reduced once at the end. No split, no reduction kernel, one launch. Together with
the tile shapes `tiles` picks, a step's projections at Qwen3-8B shape read at 93-94% of the copy
bandwidth against cuBLAS's 85-86% (two runs of `bench/gemv.py` on an H200).

Accumulation is in fp32 and the result rounded once to the weight's dtype, as cuBLAS does; only the
order of the sum differs (so bf16 results can differ from cuBLAS's in the last bit). `use_gemv`
decides whether a call takes this path; `tiles` picks the tile shape for the weight's shape.
`SPLITSERVE_GEMV=0` turns it off (read when a layer runs; decode graphs bake it in at capture).

Batch-1 decode also runs the small steps between the projections inside them (model/decoder.py's
`fused_forward`; `SPLITSERVE_GEMV_FUSE=0` keeps them separate), each a kernel of ~2 us on a step of
~4 ms:

* residual adds: a GEMV that produces the residual's update (o_proj, down_proj) adds it in place in
  its epilogue (`gemv_into_residual`), and writes what the next RMSNorm needs: the residual's sums of
  squares per output tile, and the residual times the norm's weight;
* RMSNorm: the GEMV that reads the norm's output reads that product instead and multiplies its sums
  by 1 / rms at the end (`gemv_normed`): norm(r) * w @ W.T = (w * r) @ W.T / rms(r). This skips the
  plain path's rounding of r / rms to bf16 before the weight: a bf16 step's values may differ in
  the last bit, as the GEMV's own order of summation already makes them;
* SiLU-and-multiply: down_proj reads silu(gate) * up from the gate/up output (same roundings).

The sums of squares are partials in a fixed order, never atomics, so a step's result does not
change from run to run. Not for fp16 models: w * residual is stored before the norm scales it down,
and fp16's range may not hold it (bf16's does). A prologue that normalized the input per element
instead cost as much time as the kernel it saved (`bench/gemv.py --fused` on an H200).
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from splitserve.kernels.pdl import on as pdl_on

ENABLED = os.environ.get("SPLITSERVE_GEMV", "1") != "0"  # read when a layer runs (graphs: at capture)
FUSE = os.environ.get("SPLITSERVE_GEMV_FUSE", "1") != "0"  # norms, SiLU, residual adds into the GEMVs
GEMV_MAX_N = 1 << 20  # layers with more outputs keep cuBLAS


Tile = tuple[int, int, int, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages


def tiles(n: int, k: int, kind: str = "plain") -> Tile:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a [n, k] weight: the fastest of `bench/gemv.py`'s
    sweep for each projection of Qwen3-8B on an H200, by the range its shape falls in. `kind`: the
    fused variant ("normed", "silu", "residual"; `bench/gemv.py --fused`), or "plain"."""
    if kind in ("residual", "silu"):  # o_proj, down_proj with the epilogue (`bench/gemv.py --fused`)
        return 8, 1024, 4, 3 if k >= 8192 else 4
    if k >= 8192:  # down_proj [4096 x 12288]: 95% of the copy bandwidth (cuBLAS 79%)
        return 16, 1024, 8, 3
    if n <= 4096:  # o_proj [4096 x 4096]: 75% (cuBLAS 64%)
        return 16, 1024, 8, 4
    if n <= 8192 and kind == "normed":  # fused QKV reading a NormedRow: the `--fused` sweep's fastest
        return 4, 1024, 4, 4
    if n <= 8192:  # fused QKV [6144 x 4096]: 84% (cuBLAS 73%)
        return 8, 512, 4, 4
    if n <= 65536:  # fused gate/up [24576 x 4096]: 100% (cuBLAS 99%)
        return 4, 1024, 4, 4
    return 8, 256, 4, 3  # the LM head [151936 x 4096]: 107% (cuBLAS 103%)


@triton.jit
def _input(x_ptr, offs, mask, K, SILU: tl.constexpr, EVEN: tl.constexpr, DTYPE: tl.constexpr):
    """x[offs] as fp32; SILU: x is the row [gate | up] (K each), read as silu(gate) * up with
    kernels/fused.py's `silu_mul` roundings. EVEN: no mask (`mask` is ignored)."""
    if SILU:
        if EVEN:
            g = tl.load(x_ptr + offs).to(tl.float32)
            u = tl.load(x_ptr + K + offs).to(tl.float32)
        else:
            g = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
            u = tl.load(x_ptr + K + offs, mask=mask, other=0.0).to(tl.float32)
        silu = (g / (1.0 + tl.exp(-g))).to(DTYPE).to(tl.float32)
        x = (silu * u).to(DTYPE).to(tl.float32)
    elif EVEN:
        x = tl.load(x_ptr + offs).to(tl.float32)
    else:
        x = tl.load(x_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    return x


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_w, pin_ptr, P, eps, res_ptr, nw_ptr, v_ptr, pout_ptr,
    HAS_BIAS: tl.constexpr, SILU: tl.constexpr, SCALED: tl.constexpr, RESIDUAL: tl.constexpr,
    ZERO_CENTRED: tl.constexpr, P_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    EVEN: tl.constexpr, DTYPE: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    pid = tl.program_id(0)
    rows = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    k0 = 0
    keep = rows < N
    if PDL:  # launched before the previous kernel ends (kernels/pdl.py): the next may launch now; read
        # the first weight tile (no kernel writes weights), then wait for the previous kernel's writes
        tl.extra.cuda.gdc_launch_dependents()
        w = tl.load(w_rows + cols[None, :], mask=(rows[:, None] < N) & (cols[None, :] < K), other=0.0)
    if RESIDUAL:  # the next norm's weight (a weight too: before the wait)
        nw = tl.load(nw_ptr + rows, mask=keep, other=0.0).to(tl.float32)
    if PDL:
        tl.extra.cuda.gdc_wait()
    # the epilogue's 1 / rms, from the sums of squares an earlier kernel wrote: read now, so that its
    # latency hides behind the walk over the weight instead of adding to the kernel's end
    if SCALED:  # x is w * residual (the norm's weight times the residual)
        parts = tl.load(pin_ptr + tl.arange(0, P_BLOCK), mask=tl.arange(0, P_BLOCK) < P, other=0.0)
        inv_rms = tl.rsqrt(tl.sum(parts, 0) / K + eps)
    if PDL:
        acc += w.to(tl.float32) * _input(x_ptr, cols, cols < K, K, SILU, False, DTYPE)[None, :]
        k0 = BLOCK_K
    for k in range(k0, K, BLOCK_K):
        if EVEN:
            x = _input(x_ptr, k + cols, None, K, SILU, True, DTYPE)
            w = tl.load(w_rows + k + cols[None, :])
        else:
            in_k = k + cols < K
            x = _input(x_ptr, k + cols, in_k, K, SILU, False, DTYPE)
            w = tl.load(w_rows + k + cols[None, :], mask=(rows[:, None] < N) & in_k[None, :], other=0.0)
        acc += w.to(tl.float32) * x[None, :]
    y = tl.sum(acc, axis=1)
    if SCALED:
        y *= inv_rms
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=keep, other=0.0).to(tl.float32)
    y = y.to(DTYPE)
    if RESIDUAL:  # residual += y (rounded as the fused RMSNorm adds), and what the next norm needs
        r = (tl.load(res_ptr + rows, mask=keep, other=0.0).to(tl.float32) + y.to(tl.float32)).to(DTYPE)
        tl.store(res_ptr + rows, r, mask=keep)
        r = tl.where(keep, r.to(tl.float32), 0.0)
        tl.store(pout_ptr + pid, tl.sum(r * r, 0))
        tl.store(v_ptr + rows, (r * (1.0 + nw) if ZERO_CENTRED else r * nw).to(DTYPE), mask=keep)
    else:
        tl.store(out_ptr + rows, y, mask=rows < N)


_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@dataclass(frozen=True)
class NormedRow:
    """RMSNorm(residual) * weight of one row, in the factored form a GEMV reads without a prologue:
    `scaled` = weight * residual (rounded), `partials` = the residual's sums of squares in pieces,
    both written by the residual's producing GEMV; the reading GEMV multiplies its sums by 1 / rms.
    Anything else calls `materialize` (the RMSNorm kernel, rounded as the plain path)."""

    residual: torch.Tensor  # [1, K]
    scaled: torch.Tensor  # [1, K]
    partials: torch.Tensor  # [P] fp32
    weight: torch.Tensor  # [K]
    eps: float
    zero_centred: bool

    @property
    def shape(self) -> torch.Size:
        return self.residual.shape

    def materialize(self) -> torch.Tensor:
        from splitserve.kernels.fused import rmsnorm

        return rmsnorm(self.residual, self.weight, self.eps, zero_centred=self.zero_centred)


def gemv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    block_n: int | None = None,
    block_k: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
) -> torch.Tensor:
    """x [1, K] @ weight[N, K].T (+ bias) -> [1, N] in x's dtype; the same as F.linear for one row."""
    _check(x, weight, x.shape[1])
    out = torch.empty((1, weight.shape[0]), dtype=x.dtype, device=x.device)
    given = (block_n, block_k, num_warps, num_stages)
    _launch(x, weight, bias, out, tuple(g or t for g, t in zip(given, tiles(*weight.shape), strict=True)))
    return out


def gemv_normed(
    x: NormedRow, weight: torch.Tensor, bias: torch.Tensor | None = None, tile: Tile | None = None
) -> torch.Tensor:
    """RMSNorm(x.residual) * x.weight @ weight.T (+ bias) -> [1, N], from x's factored form.
    `tile`: (BLOCK_N, BLOCK_K, warps, stages) instead of `tiles`' (bench/gemv.py's sweep)."""
    _check(x.scaled, weight, x.scaled.shape[1])
    out = torch.empty((1, weight.shape[0]), dtype=x.scaled.dtype, device=x.scaled.device)
    _launch(x.scaled, weight, bias, out, tile or tiles(*weight.shape, "normed"), normed=x)
    return out


def gemv_into_residual(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    residual: torch.Tensor,
    norm_weight: torch.Tensor,
    eps: float,
    zero_centred: bool = False,
    silu: bool = False,
    tile: Tile | None = None,
) -> NormedRow:
    """residual [1, N] += x @ weight.T (+ bias), in place, rounded as kernels/fused.py's `rmsnorm`
    adds; `silu`: x is [gate | up] and the GEMV reads silu(gate) * up. -> the next RMSNorm of the
    new residual (weight `norm_weight`), as a `NormedRow` for the GEMV that reads it."""
    _check(x, weight, x.shape[1] // 2 if silu else x.shape[1])
    n = weight.shape[0]
    if residual.shape != (1, n) or not residual.is_contiguous() or norm_weight.shape != (n,):
        raise ValueError(f"residual must be a contiguous [1, {n}] and the norm's weight [{n}]")
    if residual.dtype != x.dtype:
        raise ValueError(f"residual must be {x.dtype}, got {residual.dtype}")
    tile = tile or tiles(*weight.shape, "silu" if silu else "residual")
    partials = torch.empty(triton.cdiv(n, tile[0]), dtype=torch.float32, device=x.device)
    normed = NormedRow(residual, torch.empty_like(residual), partials, norm_weight, eps, zero_centred)
    _launch(x, weight, bias, residual, tile, silu=silu, into=normed)
    return normed


def _check(x: torch.Tensor, weight: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or k != weight.shape[1]:
        raise ValueError(
            f"gemv takes x [1, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if weight.stride(1) != 1 or not x.is_contiguous():
        raise ValueError("gemv needs the weight's rows and x contiguous")


def _launch(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    out: torch.Tensor,
    tile: Tile,
    normed: NormedRow | None = None,
    silu: bool = False,
    into: NormedRow | None = None,
) -> None:
    """One launch of `_gemv_kernel`: `out` is the output row, or with `into` the residual it adds to
    (writing `into`'s scaled row and partials); `normed`: x is its scaled row; `silu`: x is [g | u]."""
    n, k = weight.shape
    bn, bk, warps, stages = tile
    pdl = pdl_on(x.device)  # kernels/pdl.py: the first weight tile is read before the wait
    pin = normed.partials if normed is not None else weight
    dummy = weight  # any tensor, for the pointers a variant does not read
    # NOTE: Triton launches on the current device, whatever the tensors' (a model loaded on cuda:1)
    other = x.is_cuda and x.device.index != torch.cuda.current_device()
    with torch.cuda.device(x.device) if other else contextlib.nullcontext():
        _gemv_kernel[(triton.cdiv(n, bn),)](
            x, weight, bias if bias is not None else dummy, out, n, k, weight.stride(0),
            pin, pin.numel(), normed.eps if normed is not None else 0.0,
            out, into.weight if into else dummy, into.scaled if into else dummy,
            into.partials if into else dummy,
            HAS_BIAS=bias is not None, SILU=silu, SCALED=normed is not None, RESIDUAL=into is not None,
            ZERO_CENTRED=into is not None and into.zero_centred,
            P_BLOCK=triton.next_power_of_2(pin.numel()) if normed is not None else 1,
            BLOCK_N=bn, BLOCK_K=bk, EVEN=k % bk == 0 and n % bn == 0, DTYPE=_TL[x.dtype],
            PDL=pdl, num_warps=warps, num_stages=stages, launch_pdl=pdl,
        )  # fmt: skip


def use_gemv(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """This layer, for this input, takes the GEMV: one row, CUDA, 16-bit weights, at most GEMV_MAX_N
    outputs (wider ones keep cuBLAS), rows contiguous."""
    return (
        x.shape[0] == 1
        and x.dim() == 2
        and x.is_cuda
        and weight.dtype in (torch.bfloat16, torch.float16)
        and x.dtype == weight.dtype
        and weight.shape[0] <= GEMV_MAX_N
        and weight.stride(1) == 1
        and x.is_contiguous()
    )


__all__ = [
    "ENABLED",
    "FUSE",
    "GEMV_MAX_N",
    "NormedRow",
    "gemv",
    "gemv_into_residual",
    "gemv_normed",
    "tiles",
    "use_gemv",
]
