"""The paged prefill attention kernel (kernels/paged_attention.py) at Qwen3.5-9B's full-attention shape
(16 query heads, 4 KV heads, head size 256), a program's tile swept, against torch's fused causal
attention (`scaled_dot_product_attention` on the same q, k, v laid out contiguously) in the same run.

    python bench/prefill_attention_gpu.py                    # one 4,096-token prompt
    python bench/prefill_attention_gpu.py --chunks 32 --rows 512

The first tile is the shipped one (the baseline of the sweep). Every tile's output is checked against
the shipped one's (largest difference printed). TFLOP/s counts the causal half of the products:
4 x rows x (rows + 1) / 2 x head size x heads per chunk.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.conv_varlen_gpu import timed  # noqa: E402  (CUDA events, median of reps)
from splitserve.kernels.paged_attention import paged_prefill_attention  # noqa: E402

TILES = [None, (128, 64, 8, 2), (128, 32, 8, 2), (64, 32, 4, 2), (64, 64, 4, 2), (128, 64, 8, 1),
         (64, 64, 8, 3), (128, 128, 8, 1), (64, 128, 8, 2), (32, 64, 4, 2)]  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunks", type=int, default=1)
    ap.add_argument("--rows", type=int, default=4096, help="tokens a chunk (a fresh prompt: no prefix)")
    ap.add_argument("--heads", type=int, default=16)
    ap.add_argument("--kv-heads", type=int, default=4)
    ap.add_argument("--head-size", type=int, default=256)
    ap.add_argument("--block-size", type=int, default=16, help="KV cache block size (tokens)")
    ap.add_argument("--reps", type=int, default=20)
    args = ap.parse_args()
    dev, dt = torch.device("cuda"), torch.bfloat16
    p, t, h, kvh, d, bs = args.chunks, args.rows, args.heads, args.kv_heads, args.head_size, args.block_size
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(p * t, h, d, device=dev, generator=g).to(dt)
    blocks_per = -(-t // bs)
    # the cache in a shuffled block order, as a running server's free list gives it
    order = torch.randperm(p * blocks_per, device=dev, generator=g)
    k_cache = torch.randn(p * blocks_per, bs, kvh, d, device=dev, generator=g).to(dt)
    v_cache = torch.randn(p * blocks_per, bs, kvh, d, device=dev, generator=g).to(dt)
    tables = order.view(p, blocks_per).to(torch.int32)
    q_start = torch.arange(0, p * t, t, device=dev, dtype=torch.int32)
    lens = torch.full((p,), t, device=dev, dtype=torch.int32)
    out = torch.empty_like(q)
    scale = d**-0.5
    flops = 4 * t * (t + 1) / 2 * d * h * p
    peak = None
    print(f"{torch.cuda.get_device_name()}: {p} x {t} rows, {h} heads / {kvh} KV heads of {d}, bf16")

    def ours(tile):  # noqa: ANN001, ANN202
        return lambda: paged_prefill_attention(
            q, k_cache, v_cache, out, tables, q_start, lens, lens, t, scale, tile=tile
        )

    ours(None)()
    ref = out.clone()
    base = None
    for tile in TILES:
        try:
            s = timed(ours(tile), args.reps)
        except Exception as exc:  # noqa: BLE001  (a tile that does not fit the SM: reported, skipped)
            print(f"  tile {tile}: {type(exc).__name__}: {str(exc)[:80]}")
            continue
        diff = (out.float() - ref.float()).abs().max().item()
        base = base or s
        peak = s if peak is None else min(peak, s)
        print(f"  tile {tile or 'shipped'}: {s * 1e3:7.3f} ms  {flops / s / 1e12:6.1f} TFLOP/s  "
              f"{base / s:5.2f}x the shipped  max diff {diff:.2e}")  # fmt: skip
    # torch's fused attention on the same tokens, contiguous: [P, H, T, D]
    kk = k_cache[order.view(p, blocks_per).long()].reshape(p, blocks_per * bs, kvh, d)[:, :t]
    vv = v_cache[order.view(p, blocks_per).long()].reshape(p, blocks_per * bs, kvh, d)[:, :t]
    qq, kk, vv = q.view(p, t, h, d).transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2)
    sdpa = torch.nn.functional.scaled_dot_product_attention
    s = timed(lambda: sdpa(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True), args.reps)
    o = sdpa(qq, kk, vv, is_causal=True, scale=scale, enable_gqa=True).transpose(1, 2).reshape(p * t, h, d)
    print(f"  torch sdpa (contiguous, no paging): {s * 1e3:7.3f} ms  {flops / s / 1e12:6.1f} TFLOP/s  "
          f"shipped/sdpa {base / s:5.2f}x  best tile/sdpa {peak / s:5.2f}x  "
          f"max diff to shipped {(o.float() - ref.float()).abs().max().item():.2e}")  # fmt: skip


if __name__ == "__main__":
    main()
