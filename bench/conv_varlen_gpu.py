"""The varlen causal conv of Qwen3.5's Gated DeltaNet prefill (kernels/causal_conv_varlen.py) at the
9B shape, a program's tile swept: time per launch against the copy floor measured in the same run.

    python bench/conv_varlen_gpu.py                      # 32 chunks x 512 rows, 8,192 channels, bf16

The first tile is the shipped one (`TILE`): the baseline. Every other tile's output must equal it bit
for bit (the same arithmetic in the same order, per element), or the sweep says so. x is a slice of a
wider row, as the in_proj output gives it (`--row`: the 9B's 12,352 columns). Last, where the kernel
has it, the split variant the model uses (q | k | v into contiguous tensors) at the shipped tile.
"""

from __future__ import annotations

import argparse
import statistics

import torch

from splitserve.kernels.causal_conv_varlen import TILE, causal_conv1d_varlen

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


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--rows", type=int, default=512, help="rows a chunk")
    ap.add_argument("--channels", type=int, default=8192, help="9B: 2 x 16 x 128 keys + 32 x 128 values")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--row", type=int, default=12352, help="x's row stride (the in_proj output's width)")
    ap.add_argument("--key-dim", type=int, default=2048, help="q and k channels each (9B: 16 x 128)")
    ap.add_argument("--reps", type=int, default=30)
    args = ap.parse_args()
    dev = torch.device("cuda")
    t, c, k = args.chunks * args.rows, args.channels, args.width
    g = torch.Generator(device=dev).manual_seed(0)
    x = torch.randn(t, max(c, args.row), device=dev, generator=g).to(torch.bfloat16)[:, :c]
    weight = (torch.randn(c, k, device=dev, generator=g) * 0.3).to(torch.bfloat16)
    state = torch.randn(args.chunks + 1, c, k - 1, device=dev, generator=g)
    cu = torch.arange(0, t + 1, args.rows, device=dev, dtype=torch.int32)
    seq = torch.arange(t, device=dev, dtype=torch.int32) // args.rows
    slots = torch.arange(1, args.chunks + 1, device=dev, dtype=torch.int64)
    big = torch.empty(256 << 20, dtype=torch.uint8, device=dev)
    copy_s = timed(lambda: big.clone(), 10)
    bw = 2 * big.numel() / copy_s
    floor = 2 * x.numel() * x.element_size() / bw  # read x, write out
    print(f"T {t} x C {c}, width {k}, bf16; copy bandwidth {bw / 1e12:.2f} TB/s; floor {floor * 1e3:.3f} ms")
    ref = causal_conv1d_varlen(x, state, weight, cu, seq, slots)
    base = None
    for tile in TILES:
        out = torch.empty_like(ref)
        run = lambda tile=tile, out=out: causal_conv1d_varlen(x, state, weight, cu, seq, slots, out, tile)  # noqa: E731
        s = timed(run, args.reps)
        base = base or s
        same = torch.equal(out, ref)
        print(
            f"  tile {tile}: {s * 1e3:.3f} ms, {floor / s:5.1%} of floor, {base / s:4.2f}x the shipped tile"
            f"{'' if same else '  OUTPUT DIFFERS'}",
            flush=True,
        )

    try:
        from splitserve.kernels.causal_conv_varlen import causal_conv1d_varlen_split
    except ImportError:
        return
    split = lambda: causal_conv1d_varlen_split(x, state, weight, cu, seq, slots, args.key_dim)  # noqa: E731
    s = timed(split, args.reps)
    same = torch.equal(torch.cat(split(), dim=1), ref)
    print(f"  split q | k | v at {TILE}: {s * 1e3:.3f} ms, {floor / s:5.1%} of floor, {base / s:4.2f}x the "
          f"shipped tile{'' if same else '  OUTPUT DIFFERS'}")  # fmt: skip


if __name__ == "__main__":
    main()
