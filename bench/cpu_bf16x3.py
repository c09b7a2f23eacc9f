"""An fp32 product from AMX's bf16 units ("bf16x3"), against oneDNN's fp32 on the same shapes, one run.

x . w ~ xh . wh + xh . wl + xl . wh, where each operand is split into a bf16 head and a bf16 tail (h, l):
three bf16 products with fp32 sums, as one product over the inputs tripled along K ([xh | xh | xl] times
[wh | wl | wh]). Its error is ~2^-17 of each term (the dropped xl . wl and the pieces' rounding), against
fp32's 2^-24: not token-exact fp32, so only worth having if it is much faster. For the default model's
four projection shapes at `--rows` rows (prompt steps), this prints GFLOP/s of fp32 work and the
largest error against fp64 (relative to the largest output) of:

* fp32: oneDNN's matmul over the packed weight (what prompt steps run; the baseline);
* bf16 ceiling: oneDNN's bf16 matmul over the tripled K (bf16 in and out, so no use as such; the rate a
  bf16x3 product could reach, counted as fp32 work);
* onednn fpmath: the tripled fp32 inputs (pre-split, the split not timed) with
  `torch.backends.mkldnn.matmul.fp32_precision = "bf16"`: oneDNN's bf16 units, fp32 out;
* brgemm: a C++ op over torch's `at::native::cpublas::brgemm` (oneDNN's AMX ukernel, bf16 in, fp32
  out), the split included, 32-row calls over 32-column panels; also checks that a row's result does
  not depend on the other rows.

    python bench/cpu_bf16x3.py                # rows 2048 and 512
    python bench/cpu_bf16x3.py --rows 256 --reps 20
"""

from __future__ import annotations

import argparse
import tempfile
import time
from collections.abc import Callable

import torch
from torch.utils import cpp_extension

SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # SmolLM2-135M: qkv, o, gate/up, down
PANEL, ROWS_PER_CALL = 32, 32

_CPP = r"""
#include <torch/extension.h>
#include <ATen/native/CPUBlas.h>
#include <ATen/Parallel.h>
using at::BFloat16;
namespace cb = at::native::cpublas;

// w [N, K] fp32 -> [N / P, 3K, P] bf16: each panel of P outputs of [wh | wl | wh]^T in brgemm's layout
torch::Tensor pack3(torch::Tensor w, int64_t P) {
  const int64_t N = w.size(0), K = w.size(1);
  auto wh = w.to(torch::kBFloat16), wl = (w - wh.to(torch::kFloat)).to(torch::kBFloat16);
  auto t = torch::cat({wh, wl, wh}, 1).t().contiguous();
  auto out = torch::empty({N / P, 3 * K, P}, torch::kBFloat16);
  for (int64_t b = 0; b < N / P; ++b)
    cb::pack(3 * K, P, N, P, at::kBFloat16, at::kBFloat16, t.data_ptr<BFloat16>() + b * P,
             out[b].data_ptr<BFloat16>());
  return out;
}

// x [M, K] fp32 -> x [M, N] fp32 through the panels, 32 rows a call
torch::Tensor x3_linear(torch::Tensor x, torch::Tensor wp, int64_t R) {
  const int64_t M = x.size(0), K = x.size(1), NP = wp.size(0), P = wp.size(2), N = NP * P;
  auto xh = x.to(torch::kBFloat16);
  auto a = torch::cat({xh, xh, (x - xh.to(torch::kFloat)).to(torch::kBFloat16)}, 1).contiguous();
  auto out = torch::empty({M, N}, torch::kFloat);
  const BFloat16 *ap = a.data_ptr<BFloat16>(), *bp = wp.data_ptr<BFloat16>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, NP, 1, [&](int64_t b, int64_t e) {
    for (int64_t p = b; p < e; ++p)
      for (int64_t r = 0; r < M; r += R)
        cb::brgemm(std::min(R, M - r), P, 3 * K, 3 * K, P, N, false, ap + r * 3 * K, bp + p * 3 * K * P,
                   op + r * N + p * P);
    cb::brgemm_release();
  });
  return out;
}
"""


def timed(fn: Callable[[], torch.Tensor], reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def split3(t: torch.Tensor, weight: bool) -> torch.Tensor:
    """[.., K] fp32 -> [.., 3K] fp32 holding bf16 values: [th | tl | th] (weight) or [th | th | tl]."""
    h = t.bfloat16().float()
    lo = (t - h).bfloat16().float()
    return torch.cat([h, lo, h] if weight else [h, h, lo], -1)


def fpmath_bf16(x3: torch.Tensor, packed: torch.Tensor) -> torch.Tensor:
    torch.backends.mkldnn.matmul.fp32_precision = "bf16"
    try:
        return torch.ops.mkldnn._linear_pointwise(x3, packed, None, "none", [], "")
    finally:
        torch.backends.mkldnn.matmul.fp32_precision = "ieee"


def measure(ext: object, m: int, n: int, k: int, reps: int) -> dict[str, tuple[float, float]]:
    """-> {path: (seconds a product, largest error relative to the largest output)}; "invariant" holds
    (1.0 or 0.0, whether brgemm's first rows alone equal them in the full product, 0)."""
    x, w = torch.randn(m, k), torch.randn(n, k) * 0.05
    ref = x.double() @ w.double().t()
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    x3, w3 = split3(x, weight=False), split3(w, weight=True)
    packed3, packed3b = (torch.ops.mkldnn._reorder_linear_weight(t) for t in (w3, w3.bfloat16()))
    x3b, panels = x3.bfloat16(), ext.pack3(w, PANEL)  # type: ignore[attr-defined]
    runs: dict[str, Callable[[], torch.Tensor]] = {
        "fp32": lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""),
        "ceiling": lambda: torch.ops.mkldnn._linear_pointwise(x3b, packed3b, None, "none", [], ""),
        "fpmath": lambda: fpmath_bf16(x3, packed3),
        "brgemm": lambda: ext.x3_linear(x, panels, ROWS_PER_CALL),  # type: ignore[attr-defined]
    }
    out = {}
    for name, fn in runs.items():
        y = fn().float()
        out[name] = (timed(fn, reps), ((y.double() - ref).abs().max() / ref.abs().max()).item())
    head = ext.x3_linear(x[:7].contiguous(), panels, ROWS_PER_CALL)  # type: ignore[attr-defined]
    out["invariant"] = (float(torch.equal(head, runs["brgemm"]()[:7])), 0.0)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[2048, 512])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    build = tempfile.mkdtemp(prefix="bf16x3-")
    ext = cpp_extension.load_inline("bf16x3", _CPP, functions=["pack3", "x3_linear"],
                                    extra_cflags=["-O3"], build_directory=build)  # fmt: skip
    cap = torch.backends.cpu.get_cpu_capability()
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, {cap}")
    print("GF/s of fp32 work (largest error against fp64, relative to the largest output)\n")
    print("| rows | N x K | fp32 | bf16 ceiling | onednn fpmath | brgemm | brgemm row-invariant |")
    print("|---|---|---|---|---|---|---|")
    torch.manual_seed(0)
    for m in args.rows:
        sums = dict.fromkeys(("fp32", "fpmath", "brgemm"), 0.0)
        for n, k in SHAPES:
            r = measure(ext, m, n, k, args.reps)
            for name in sums:
                sums[name] += r[name][0]
            cells = [f"{2 * m * n * k / r[p][0] / 1e9:.0f} ({r[p][1]:.1e})" for p in ("fp32", "ceiling")]
            cells += [f"{2 * m * n * k / r[p][0] / 1e9:.0f} ({r[p][1]:.1e})" for p in ("fpmath", "brgemm")]
            print(f"| {m} | {n} x {k} | " + " | ".join(cells) + f" | {bool(r['invariant'][0])} |")
        fp, br = sums["fp32"] / sums["fpmath"], sums["fp32"] / sums["brgemm"]
        print(f"| {m} | the four, speed against fp32 | 1.00x | | {fp:.2f}x | {br:.2f}x | |")


if __name__ == "__main__":
    main()
