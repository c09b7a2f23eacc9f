"""CPU projections for a decode step's few rows: an AVX-512 fp32 matmul over weights packed in panels.

At 4-128 rows (decode batches) oneDNN's matmul runs far below the box's fp32 rate: it does not start
reading a cold weight before it needs it, so each product waits on memory and then computes
(docs/bench/cpu-engine.md: ~175 GFLOP/s at 64 rows against ~315 at 2048). This op keeps
each projection's weight as panels of 32 output columns, [ceil(N / 32), K, 32] (zeros past N), so that
a panel is one contiguous stream; the threads take whole panels; within a panel, tiles of up to 12
rows keep 24 accumulators (12 rows x 32 columns) in registers while the panel's rows of 32 weights
stream past, and the next panel is prefetched into L2 a line every few steps of the current one.
`python bench/cpu_gemm_op.py` measures it against oneDNN and MKL in one run.

Each output is one fp32 sum over k in order, whatever the batch, the tile or the thread count: a row's
projections do not depend on the other rows of its batch or on the threads (tests/model/test_cpu_gemm.py).
oneDNN and MKL sum in other orders: outputs differ from theirs by ~1e-6 relative, and greedy output
stays token-exact with HF on the parity tests.

Used by `cpu_linear.OneDNNMatmul` for 1 to `MAX_ROWS` rows on hosts with AVX-512 (torch's CPU
capability), beyond that oneDNN; it replaces MKL's GEMV for one and two rows (as fast, measured) and
thereby the dense weights kept for it. Built on first use like the other CPU ops (kernels/cpu/build.py);
until it is loaded the projections take oneDNN. `SPLITSERVE_CPU_GEMM=0` turns it off.
"""

from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from splitserve.kernels.cpu.build import CppOps

ENABLED = os.environ.get("SPLITSERVE_CPU_GEMM", "1") != "0"
PANEL = 32  # output columns a panel (two 16-float vectors)
MAX_ROWS = 128  # above this oneDNN's blocking wins (bench/cpu_gemm_op.py)

_SOURCE = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <optional>

constexpr int64_t NB = 32;  // columns a panel
constexpr int RMAX = 12;    // rows a tile: 24 accumulators, 2 weight vectors, 1 broadcast

// C[r, 0:ncols] = A[r, :] . panel (+ bias) for R rows; while it runs, prefetch `nlines` 64-byte lines of
// the next panel (from `next`) into L2, one every `K / nlines` steps
template <int R>
static void tile(const float* a, int64_t K, const float* panel, const float* bias, float* c, int64_t ldc,
                 int64_t ncols, const float* next, int64_t nlines) {
  __m512 acc[R][2];
  for (int r = 0; r < R; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  const int64_t every = nlines > 0 ? std::max<int64_t>(1, K / nlines) : K + 1;
  int64_t line = 0;
  for (int64_t k = 0; k < K; ++k) {
    const __m512 w0 = _mm512_loadu_ps(panel + k * NB), w1 = _mm512_loadu_ps(panel + k * NB + 16);
    if (k % every == 0 && line < nlines)
      _mm_prefetch(reinterpret_cast<const char*>(next + 16 * line++), _MM_HINT_T1);
    for (int r = 0; r < R; ++r) {
      const __m512 x = _mm512_set1_ps(a[r * K + k]);
      acc[r][0] = _mm512_fmadd_ps(x, w0, acc[r][0]);
      acc[r][1] = _mm512_fmadd_ps(x, w1, acc[r][1]);
    }
  }
  const __mmask16 m0 = ncols >= 16 ? 0xFFFF : static_cast<__mmask16>((1u << ncols) - 1);
  const __mmask16 m1 =
      ncols >= 32 ? 0xFFFF : ncols <= 16 ? 0 : static_cast<__mmask16>((1u << (ncols - 16)) - 1);
  __m512 b0 = _mm512_setzero_ps(), b1 = _mm512_setzero_ps();
  if (bias != nullptr) {
    b0 = _mm512_maskz_loadu_ps(m0, bias);
    b1 = _mm512_maskz_loadu_ps(m1, bias + 16);
  }
  for (int r = 0; r < R; ++r) {
    _mm512_mask_storeu_ps(c + r * ldc, m0, bias ? _mm512_add_ps(acc[r][0], b0) : acc[r][0]);
    _mm512_mask_storeu_ps(c + r * ldc + 16, m1, bias ? _mm512_add_ps(acc[r][1], b1) : acc[r][1]);
  }
}

using TileFn = void (*)(const float*, int64_t, const float*, const float*, float*, int64_t, int64_t,
                        const float*, int64_t);
static const TileFn TILES[RMAX + 1] = {nullptr,  tile<1>, tile<2>, tile<3>,  tile<4>,  tile<5>, tile<6>,
                                       tile<7>,  tile<8>, tile<9>, tile<10>, tile<11>, tile<12>};

// a [M, K] fp32 contiguous; panels [P, K, 32] (from `pack`); n outputs -> [M, n]
static at::Tensor panel_mm(const at::Tensor& a, const at::Tensor& panels, int64_t n,
                           const std::optional<at::Tensor>& bias) {
  TORCH_CHECK(a.scalar_type() == at::kFloat && panels.scalar_type() == at::kFloat, "panel_mm: fp32 only");
  TORCH_CHECK(a.dim() == 2 && a.is_contiguous() && panels.dim() == 3 && panels.is_contiguous() &&
              panels.size(2) == NB, "panel_mm: shapes");
  const int64_t M = a.size(0), K = a.size(1), P = panels.size(0);
  TORCH_CHECK(panels.size(1) == K && n > (P - 1) * NB && n <= P * NB, "panel_mm: the panels do not fit");
  const float* bp = nullptr;
  if (bias.has_value() && bias->defined()) {
    TORCH_CHECK(bias->scalar_type() == at::kFloat && bias->is_contiguous() && bias->numel() == n,
                "panel_mm: bias");
    bp = bias->data_ptr<float>();
  }
  auto c = at::empty({M, n}, a.options());
  if (M == 0) return c;
  const float* ap = a.data_ptr<float>();
  const float* wp = panels.data_ptr<float>();
  float* cp = c.data_ptr<float>();
  const int64_t tiles = (M + RMAX - 1) / RMAX, lines = K * NB / 16, per = (lines + tiles - 1) / tiles;
  at::parallel_for(0, P, 1, [&](int64_t begin, int64_t end) {
    for (int64_t p = begin; p < end; ++p) {
      const float* panel = wp + p * K * NB;
      const float* next = p + 1 < end ? panel + K * NB : nullptr;
      const int64_t ncols = std::min<int64_t>(NB, n - p * NB);
      for (int64_t t = 0; t < tiles; ++t) {
        const int64_t m0 = t * RMAX, l0 = std::min(lines, t * per);
        const int64_t nl = next ? std::min(lines, l0 + per) - l0 : 0;
        const TileFn fn = TILES[std::min<int64_t>(RMAX, M - m0)];
        fn(ap + m0 * K, K, panel, bp ? bp + p * NB : nullptr, cp + m0 * n + p * NB, n, ncols,
           next ? next + l0 * 16 : nullptr, nl);
      }
    }
  });
  return c;
}

TORCH_LIBRARY(splitserve_cpu_gemm, m) {
  m.def("panel_mm(Tensor a, Tensor panels, int n, Tensor? bias) -> Tensor");
}
TORCH_LIBRARY_IMPL(splitserve_cpu_gemm, CPU, m) { m.impl("panel_mm", &panel_mm); }
"""


def _supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


LIB = CppOps("splitserve_cpu_gemm_v1", _SOURCE, ["-O3", "-mavx512f", "-mavx512dq", "-mavx2", "-mfma"],
             ENABLED and _supported(), "CPU small-batch matmul")  # fmt: skip


def start() -> bool:
    """For an engine: build (or load) it in the background on an AVX-512 host unless switched off
    (`LIB.enabled`); -> whether so: then projections keep panels."""
    return LIB.start()


def ready() -> bool:
    return LIB.ready()


def load(force: bool = False) -> bool:
    """Build (or find) and load the op now; `force` ignores the switch (tests, benches), not the host."""
    return _supported() and LIB.load(force)


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 -> [ceil(N / 32), K, 32]: panel p holds outputs 32p.. as rows of 32 weights, one row
    per input k (zeros past N)."""
    n, k = weight.shape
    pad = -n % PANEL
    with torch.no_grad():
        w = F.pad(weight.detach().float(), (0, 0, 0, pad)) if pad else weight.detach().float()
        return w.view(-1, PANEL, k).transpose(1, 2).contiguous()


def matmul(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, bias) with W packed by `pack` (n: W's rows). x [..., K] -> [..., n]."""
    flat = x.reshape(-1, x.shape[-1]).contiguous()
    out = torch.ops.splitserve_cpu_gemm.panel_mm(flat, panels, n, bias)
    return out if x.dim() == 2 else out.view(*x.shape[:-1], n)


__all__ = ["MAX_ROWS", "load", "matmul", "pack", "ready", "start"]
