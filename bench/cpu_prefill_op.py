"""The CPU prompt attention op (kernels/cpu/prefill.py) alone, against the SDPA path it replaces.

One layer of the default model's shape (9 query heads, 3 KV heads, head_dim 64, blocks of 16 scattered
in the pool) over one prompt of each `--lengths`: the torch path (`_attend_fresh`: K/V repeated per
query head, then SDPA with `is_causal`) against the op reading the cache in place; the median of
`--iters` calls each, alternating, the ratio, and the op's rate in GFLOP/s of the causal half
(4 * T^2 / 2 * H * D). Needs AVX-512.

    python bench/cpu_prefill_op.py
    python bench/cpu_prefill_op.py --lengths 256 2048 --iters 50
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.model import cpu_prefill  # noqa: E402

H, KVH, D, BS = 9, 3, 64, 16


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=[256, 1024, 2048])
    ap.add_argument("--iters", type=int, default=30)
    args = ap.parse_args()
    t = time.perf_counter()
    if not cpu_prefill.load(force=True):
        print("the op could not be built here (it needs AVX-512 and a C++ compiler)")
        return 1
    print(f"op build/load: {time.perf_counter() - t:.1f} s; {torch.get_num_threads()} threads")
    print("| prompt tokens | repeat + SDPA ms | op ms | ratio | op GFLOP/s |")
    print("|---|---|---|---|---|")
    g = torch.Generator().manual_seed(0)
    for n in args.lengths:
        q = torch.randn(n, H, D, generator=g)
        blocks = (n + BS - 1) // BS
        k_cache = torch.randn(blocks * 4, BS, KVH, D, generator=g)
        v_cache = torch.randn_like(k_cache)
        table = torch.randperm(blocks * 4, generator=g)[:blocks]
        k = k_cache[table].flatten(0, 1)[:n]  # the prompt's K/V as the torch path has them
        v = v_cache[table].flatten(0, 1)[:n]

        def sdpa(q=q, k=k, v=v) -> torch.Tensor:
            keys = k.transpose(0, 1).repeat_interleave(H // KVH, dim=0)
            values = v.transpose(0, 1).repeat_interleave(H // KVH, dim=0)
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None], is_causal=True, scale=D**-0.5
            )
            return out[0].transpose(0, 1)

        def op(q=q, kc=k_cache, vc=v_cache, table=table, n=n) -> torch.Tensor:
            return cpu_prefill.prefill_attention(q, kc, vc, table, n, D**-0.5)

        torch.testing.assert_close(op(), sdpa(), rtol=1e-4, atol=1e-4)
        times: dict[str, list[float]] = {"sdpa": [], "op": []}
        for _ in range(args.iters):
            for name, fn in (("sdpa", sdpa), ("op", op)):
                t = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - t)
        a, b = (statistics.median(times[k]) * 1e3 for k in ("sdpa", "op"))
        flops = 4 * n * n / 2 * H * D
        print(f"| {n} | {a:.2f} | {b:.2f} | {a / b:.2f}x | {flops / b / 1e6:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
