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
"""

from __future__ import annotations

import contextlib
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("SPLITSERVE_GEMV", "1") != "0"  # read when a layer runs (graphs: at capture)
GEMV_MAX_N = 1 << 20  # layers with more outputs keep cuBLAS
BLOCK_N = 8  # the defaults (`bench/gemv.py --quick`); `tiles` picks per shape
BLOCK_K = 512
NUM_WARPS = 4
NUM_STAGES = 4


def tiles(n: int, k: int) -> tuple[int, int, int, int]:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a [n, k] weight: the fastest of `bench/gemv.py`'s
    sweep for each projection of Qwen3-8B on an H200, by the range its shape falls in."""
    if k >= 8192:  # down_proj [4096 x 12288]: 95% of the copy bandwidth (cuBLAS 79%)
        return 16, 1024, 8, 3
    if n <= 4096:  # o_proj [4096 x 4096]: 75% (cuBLAS 64%)
        return 16, 1024, 8, 4
    if n <= 8192:  # fused QKV [6144 x 4096]: 84% (cuBLAS 73%)
        return 8, 512, 4, 4
    if n <= 65536:  # fused gate/up [24576 x 4096]: 100% (cuBLAS 99%)
        return 4, 1024, 4, 4
    return 8, 256, 4, 3  # the LM head [151936 x 4096]: 107% (cuBLAS 103%)


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr, N, K, stride_w,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN: tl.constexpr,
):  # fmt: skip
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    cols = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + rows.to(tl.int64)[:, None] * stride_w
    acc = tl.zeros((BLOCK_N, BLOCK_K), dtype=tl.float32)
    for k in range(0, K, BLOCK_K):
        if EVEN:
            x = tl.load(x_ptr + k + cols)
            w = tl.load(w_rows + k + cols[None, :])
        else:
            in_k = k + cols < K
            x = tl.load(x_ptr + k + cols, mask=in_k, other=0.0)
            w = tl.load(w_rows + k + cols[None, :], mask=(rows[:, None] < N) & in_k[None, :], other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    y = tl.sum(acc, axis=1)
    if HAS_BIAS:
        y += tl.load(b_ptr + rows, mask=rows < N, other=0.0).to(tl.float32)
    tl.store(out_ptr + rows, y.to(out_ptr.dtype.element_ty), mask=rows < N)


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
    if x.dim() != 2 or x.shape[0] != 1 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(
            f"gemv takes x [1, K] and weight [N, K], got {tuple(x.shape)}, {tuple(weight.shape)}"
        )
    if weight.stride(1) != 1 or not x.is_contiguous():
        raise ValueError("gemv needs the weight's rows and x contiguous")
    n, k = weight.shape
    picked = tiles(n, k)
    bn, bk = block_n or picked[0], block_k or picked[1]
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    even = k % bk == 0 and n % bn == 0
    # NOTE: Triton launches on the current device, whatever the tensors' (a model loaded on cuda:1)
    other = x.is_cuda and x.device.index != torch.cuda.current_device()
    with torch.cuda.device(x.device) if other else contextlib.nullcontext():
        _gemv_kernel[(triton.cdiv(n, bn),)](
            x, weight, bias if bias is not None else weight, out, n, k, weight.stride(0),
            HAS_BIAS=bias is not None, BLOCK_N=bn, BLOCK_K=bk, EVEN=even,
            num_warps=num_warps or picked[2], num_stages=num_stages or picked[3],
        )  # fmt: skip
    return out


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


__all__ = ["ENABLED", "GEMV_MAX_N", "gemv", "tiles", "use_gemv"]
