"""The varlen causal conv of Qwen3.5's Gated DeltaNet prefill (kernels/causal_conv_varlen.py) at the
9B shape, a program's tile swept: time per launch against the copy floor measured in the same run.

    python bench/conv_varlen_gpu.py                      # 32 chunks x 512 rows, 8,192 channels, bf16

    TRITON_INTERPRET=1 python bench/conv_varlen_gpu.py --cpu-check   # row walker == shipped, on CPU

The first tile is the shipped one (`TILE`): the baseline. Every other tile's output must equal it bit
for bit (the same arithmetic in the same order, per element), or the sweep says so. x is a slice of a
wider row, as the in_proj output gives it (`--row`: the 9B's 12,352 columns). Then a candidate kernel
defined here, `_conv_rows_kernel`: a program walks its rows one after another, keeping the last K - 1
inputs in registers (each x row loaded once, not K times; the rows unrolled, so their loads can all be
in flight), over a few tiles. Last, where the kernel has it, the split variant the model uses (q | k |
v into contiguous tensors) and its fused q/k L2 norm at the shipped tile.
"""

from __future__ import annotations

import argparse
import statistics

import torch
import triton
import triton.language as tl

from splitserve.kernels.causal_conv_varlen import TILE, causal_conv1d_varlen
from splitserve.kernels.gated_delta import _round_to

# rows, channels, warps: a row of BLOCK_C channels spread over the warps' threads, 8 bf16 (16 bytes) a
# thread where BLOCK_C = 256 x warps
ROW_TILES = [
    (16, 128, 4),
    (32, 256, 1),
    (64, 256, 1),
    (32, 512, 2),
    (64, 512, 2),
    (32, 1024, 4),
    (64, 1024, 4),
]


@triton.jit
def _silu_store(acc, optr, mask, wdt: tl.constexpr, odt: tl.constexpr):
    """The shipped kernel's epilogue for one output row: rounded as the torch path rounds it."""
    y = _round_to(acc, wdt)
    y = _round_to(_round_to(y / (1.0 + tl.exp(-y)), wdt), odt)
    tl.store(optr, y.to(odt), mask=mask)


@triton.jit
def _conv_rows_kernel(
    x_ptr, state_ptr, w_ptr, cu_ptr, seq_ptr, slot_ptr, out_ptr, T, C,
    stride_xt, stride_xc, stride_ss, stride_sc, stride_sk, stride_wc, stride_wk, stride_ot, stride_oc,
    KW: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr,
):  # fmt: skip
    """The shipped `_conv_varlen_kernel`'s arithmetic (unsplit output), a program walking its rows one
    by one: in a tile wholly inside a chunk with a register window over the last three inputs (K = 4),
    else each row's taps read from x or its chunk's conv window."""
    tl.static_assert(KW == 4)
    r0 = tl.program_id(0) * BLOCK_T
    c0 = tl.program_id(1) * BLOCK_C
    dr, dc = tl.arange(0, BLOCK_T), tl.arange(0, BLOCK_C)
    rows = r0 + dr
    mr, mc = rows < T, c0 + dc < C
    pos = rows - tl.load(cu_ptr + tl.load(seq_ptr + rows, mask=mr, other=0), mask=mr, other=0).to(tl.int32)
    wdt: tl.constexpr = w_ptr.dtype.element_ty
    odt: tl.constexpr = out_ptr.dtype.element_ty
    x_blk = x_ptr + r0.to(tl.int64) * stride_xt + c0.to(tl.int64) * stride_xc
    o_blk = out_ptr + r0.to(tl.int64) * stride_ot + c0.to(tl.int64) * stride_oc
    xc, oc, w_col = dc * stride_xc, dc * stride_oc, w_ptr + (c0 + dc) * stride_wc
    w0 = tl.load(w_col, mask=mc, other=0.0).to(tl.float32)
    w1 = tl.load(w_col + stride_wk, mask=mc, other=0.0).to(tl.float32)
    w2 = tl.load(w_col + 2 * stride_wk, mask=mc, other=0.0).to(tl.float32)
    w3 = tl.load(w_col + 3 * stride_wk, mask=mc, other=0.0).to(tl.float32)
    if tl.min(tl.where(mr, pos, KW), 0) >= KW - 1:  # every row's taps inside x: the register window
        a0 = _round_to(tl.load(x_blk - 3 * stride_xt + xc, mask=mc, other=0.0).to(tl.float32), wdt)
        a1 = _round_to(tl.load(x_blk - 2 * stride_xt + xc, mask=mc, other=0.0).to(tl.float32), wdt)
        a2 = _round_to(tl.load(x_blk - stride_xt + xc, mask=mc, other=0.0).to(tl.float32), wdt)
        for i in tl.static_range(BLOCK_T):
            m = mc & (r0 + i + dc * 0 < T)  # a vector compare: the interpreter refuses int1 scalar & vector
            a3 = _round_to(tl.load(x_blk + i * stride_xt + xc, mask=m, other=0.0).to(tl.float32), wdt)
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            acc += a0 * w0
            acc += a1 * w1
            acc += a2 * w2
            acc += a3 * w3
            _silu_store(acc, o_blk + i * stride_ot + oc, m, wdt, odt)
            a0, a1, a2 = a1, a2, a3
    else:  # a chunk starts in the tile: per row, tap j from x or (pos + j) of the row's conv window
        for i in tl.static_range(BLOCK_T):
            row = r0 + i
            seq = tl.load(seq_ptr + row, mask=row < T, other=0)
            p = row - tl.load(cu_ptr + seq, mask=row < T, other=0).to(tl.int32)
            slot = tl.load(slot_ptr + seq, mask=row < T, other=0).to(tl.int64)
            s_col = state_ptr + slot * stride_ss + (c0 + dc).to(tl.int64) * stride_sc
            m = mc & (row + dc * 0 < T)
            acc = tl.zeros([BLOCK_C], dtype=tl.float32)
            for j in tl.static_range(KW):
                in_x = p + dc * 0 >= KW - 1 - j
                xv = tl.load(x_blk + (i - (KW - 1 - j)) * stride_xt + xc, mask=m & in_x, other=0.0)
                sv = tl.load(s_col + (p + j) * stride_sk, mask=m & ~in_x, other=0.0)
                v = tl.where(in_x, xv.to(tl.float32), _round_to(sv, x_ptr.dtype.element_ty))
                w = tl.load(w_col + j * stride_wk, mask=mc, other=0.0).to(tl.float32)
                acc += _round_to(v, wdt) * w
            _silu_store(acc, o_blk + i * stride_ot + oc, m, wdt, odt)


def conv_rows(x, state, weight, cu, seq, slots, out, tile):  # noqa: ANN001, ANN201
    """`causal_conv1d_varlen(..., out, tile)` by `_conv_rows_kernel`."""
    t, c = x.shape
    weight = weight.reshape(c, -1)
    block_t, block_c, warps = tile
    grid = (triton.cdiv(t, block_t), triton.cdiv(c, block_c))
    _conv_rows_kernel[grid](
        x, state, weight, cu, seq, slots, out, t, c, *x.stride(), *state.stride(), *weight.stride(),
        *out.stride(), KW=weight.shape[1], BLOCK_T=block_t, BLOCK_C=block_c, num_warps=warps,
    )  # fmt: skip
    return out


TILES = [TILE, (8, 128, 4), (32, 128, 4), (64, 128, 4), (32, 128, 8), (64, 128, 8),
         (32, 256, 4), (64, 256, 8), (16, 64, 2), (32, 64, 4), (16, 256, 4)]  # fmt: skip


def timed(fn, reps: int) -> float:
    """Median seconds of `reps` launches (CUDA events), after 3 untimed."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    return statistics.median(times)


def inputs(chunks: int, rows: int, c: int, k: int, row: int, dev: torch.device):
    """x [T, C] bf16 (a slice of wider rows), taps, fp32 windows and the chunk tables of `chunks`
    chunks of `rows` rows."""
    t = chunks * rows
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, max(c, row), device=dev, generator=g).to(torch.bfloat16)[:, :c]
    weight = (torch.randn(c, k, device=dev, generator=g) * 0.3).to(torch.bfloat16)
    state = torch.randn(chunks + 1, c, k - 1, device=dev, generator=g)
    cu = torch.arange(0, t + 1, rows, device=dev, dtype=torch.int32)
    seq = torch.arange(t, device=dev, dtype=torch.int32) // rows
    slots = torch.arange(1, chunks + 1, device=dev, dtype=torch.int64)
    return x, state, weight, cu, seq, slots


def cpu_check() -> None:
    """`_conv_rows_kernel` against the shipped kernel on a small shape under Triton's interpreter (37-row
    chunks: chunk starts inside every tile size, and tiles wholly inside a chunk)."""
    x, state, weight, cu, seq, slots = inputs(5, 37, 96, 4, 100, torch.device("cpu"))
    ref = causal_conv1d_varlen(x, state, weight, cu, seq, slots)
    for tile in ROW_TILES:
        out = conv_rows(x, state, weight, cu, seq, slots, torch.full_like(ref, float("nan")), tile)
        print(f"  rows {tile}: {'equal' if torch.equal(out, ref) else 'OUTPUT DIFFERS'}", flush=True)


def line(name: str, s: float, floor: float, base: float, same: bool) -> None:
    print(
        f"  {name}: {s * 1e3:.3f} ms, {floor / s:5.1%} of floor, {base / s:4.2f}x the shipped tile"
        f"{'' if same else '  OUTPUT DIFFERS'}",
        flush=True,
    )


def split_and_norm(
    args: argparse.Namespace, data: tuple, ref: torch.Tensor, floor: float, base: float
) -> None:
    """The split q | k | v variant, and its fused q/k L2 norm against the split plus fla's two
    `l2norm_fwd` launches (what the rule ran before)."""
    from splitserve.kernels import causal_conv_varlen as ccv

    if not hasattr(ccv, "causal_conv1d_varlen_split"):
        return
    split = lambda: ccv.causal_conv1d_varlen_split(*data, args.key_dim)  # noqa: E731
    s = timed(split, args.reps)
    line(f"split q | k | v at {TILE}", s, floor, base, torch.equal(torch.cat(split(), dim=1), ref))
    if not hasattr(ccv, "can_fuse_qk_l2norm") or not ccv.can_fuse_qk_l2norm(args.key_dim, args.head_dim):
        return
    fused = lambda: ccv.causal_conv1d_varlen_split(*data, args.key_dim, qk_norm_dim=args.head_dim)  # noqa: E731
    s_fused = timed(fused, args.reps)
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
    except ImportError:
        line("split + q/k L2 norm fused", s_fused, floor, base, True)
        return

    def unfused() -> tuple[torch.Tensor, torch.Tensor]:
        q, k, _ = split()
        shape = (q.shape[0], -1, args.head_dim)
        return l2norm_fwd(q.view(shape))[0], l2norm_fwd(k.view(shape))[0]

    s_unfused = timed(unfused, args.reps)
    (fq, fk, _), (uq, uk) = fused(), unfused()
    differ = sum(int((a.view_as(b) != b).sum()) for a, b in ((fq, uq), (fk, uk)))
    print(
        f"  split + fla l2norm_fwd x 2: {s_unfused * 1e3:.3f} ms; split with the norm fused: "
        f"{s_fused * 1e3:.3f} ms ({s_unfused / s_fused:4.2f}x); q/k elements differing from fla's: "
        f"{differ} of {2 * fq.numel()}",
        flush=True,
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--rows", type=int, default=512, help="rows a chunk")
    ap.add_argument("--channels", type=int, default=8192, help="9B: 2 x 16 x 128 keys + 32 x 128 values")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--row", type=int, default=12352, help="x's row stride (the in_proj output's width)")
    ap.add_argument("--key-dim", type=int, default=2048, help="q and k channels each (9B: 16 x 128)")
    ap.add_argument("--head-dim", type=int, default=128, help="the key head dim (the fused L2 norm's)")
    ap.add_argument("--reps", type=int, default=30)
    ap.add_argument(
        "--cpu-check", action="store_true", help="with TRITON_INTERPRET=1: the row walker's output"
    )
    args = ap.parse_args()
    if args.cpu_check:
        return cpu_check()
    dev = torch.device("cuda")
    data = inputs(args.chunks, args.rows, args.channels, args.width, args.row, dev)
    x = data[0]
    big = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    copy_s = timed(lambda: big.clone(), 10)
    bw = 2 * big.numel() / copy_s
    floor = 2 * x.numel() * x.element_size() / bw  # read x, write out
    print(f"T {x.shape[0]} x C {x.shape[1]}, width {args.width}, bf16; copy bandwidth {bw / 1e12:.2f} TB/s; "
          f"floor {floor * 1e3:.3f} ms")  # fmt: skip
    ref = causal_conv1d_varlen(*data)
    base = None
    for tile in TILES:
        out = torch.empty_like(ref)
        s = timed(lambda tile=tile, out=out: causal_conv1d_varlen(*data, out, tile), args.reps)
        base = base or s
        line(f"tile {tile}", s, floor, base, torch.equal(out, ref))
    for tile in ROW_TILES:
        out = torch.empty_like(ref)
        s = timed(lambda tile=tile, out=out: conv_rows(*data, out, tile), args.reps)
        line(f"row walker {tile}", s, floor, base, torch.equal(out, ref))
    split_and_norm(args, data, ref, floor, base)


if __name__ == "__main__":
    main()
