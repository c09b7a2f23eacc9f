"""The small-batch CPU matmul (kernels/cpu/gemm.py) alone, against oneDNN (packed weights, the engine's
path above cpu_gemm.MAX_ROWS) and MKL (`F.linear`, its GEMV at one or two rows), over the default
model's projections: 30 layers x (QKV 576->960, O 576->576, gate/up 576->3072, down 1536->576) and the
LM head (576->49152), every weight its own tensor so that each product reads it from memory, as in a
decode step. Per row count: the median of `--reps` passes over all 121 products for each path,
alternating, their GFLOP/s, the ratios, and the op's share of the fp32 matmul rate measured in the
same run (oneDNN at 2048^3, warm). Needs AVX-512.

    python bench/cpu_gemm_op.py
    python bench/cpu_gemm_op.py --rows 1 4 64 --reps 9
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.kernels.cpu.linear import pack, packed_linear  # noqa: E402
from splitserve.model import cpu_gemm  # noqa: E402

SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out) of each layer's projections


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 2, 4, 16, 64, 128, 256])
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    t = time.perf_counter()
    if not cpu_gemm.load(force=True):
        print("the op could not be built here (it needs AVX-512 and a C++ compiler)")
        return 1
    print(f"op build/load: {time.perf_counter() - t:.1f} s; {torch.get_num_threads()} threads")
    rate = _matmul_rate()
    print(f"fp32 matmul rate (oneDNN, 2048^3, warm): {rate:.0f} GFLOP/s")
    g = torch.Generator().manual_seed(0)
    dense = [torch.randn(n, k, generator=g) * 0.02 for _ in range(30) for k, n in SHAPES]
    dense.append(torch.randn(49152, 576, generator=g) * 0.02)
    onednn = [pack(w) for w in dense]
    panels = [cpu_gemm.pack(w) for w in dense]
    flop_row = 2 * sum(w.numel() for w in dense)
    pairs = list(zip(dense, onednn, panels, strict=True))
    print(
        "| rows | MKL (F.linear) ms | oneDNN ms | op ms | op / oneDNN | op / MKL | op GFLOP/s | of the rate |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for rows in tqdm(args.rows, desc="row counts", leave=False):
        xs = {k: torch.randn(rows, k, generator=g) for k in (576, 1536)}
        for w, p in zip(dense[:4], panels[:4], strict=True):
            x = xs[w.shape[1]]
            torch.testing.assert_close(
                cpu_gemm.matmul(x, p, w.shape[0], None), F.linear(x, w), rtol=1e-4, atol=1e-4
            )
        paths = {
            "mkl": lambda xs=xs: [F.linear(xs[w.shape[1]], w) for w in dense],
            "onednn": lambda xs=xs: [packed_linear(xs[w.shape[1]], p, None) for w, p, _ in pairs],
            "op": lambda xs=xs: [cpu_gemm.matmul(xs[w.shape[1]], q, w.shape[0], None) for w, _, q in pairs],
        }
        times: dict[str, list[float]] = {k: [] for k in paths}
        for _ in range(args.reps):  # alternating, one pass over all 121 products each
            for name, fn in paths.items():
                s = time.perf_counter()
                fn()
                times[name].append(time.perf_counter() - s)
        m, o, op = (statistics.median(times[k]) for k in ("mkl", "onednn", "op"))
        gf = rows * flop_row / op / 1e9
        print(f"| {rows} | {m * 1e3:.1f} | {o * 1e3:.1f} | {op * 1e3:.1f} | {o / op:.2f}x | {m / op:.2f}x | "
              f"{gf:.0f} | {gf / rate:.0%} |")  # fmt: skip
    return 0


def _matmul_rate() -> float:
    a, w = torch.randn(2048, 2048), pack(torch.randn(2048, 2048))
    for _ in range(3):
        packed_linear(a, w, None)
    best = min(_timed(packed_linear, a, w) for _ in range(5))
    return 2 * 2048**3 / best / 1e9


def _timed(fn, *args) -> float:  # noqa: ANN001, ANN002
    t = time.perf_counter()
    fn(*args, None)
    return time.perf_counter() - t


if __name__ == "__main__":
    raise SystemExit(main())
