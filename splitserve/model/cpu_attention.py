"""CPU decode attention that reads the paged KV blocks where they are (a small C++ op, built on first use).

The torch path (`attention.TorchPagedAttention._decode`) gathers every sequence's blocks into a fresh
[B, KVH, L, D] copy for K and for V, then runs SDPA over the copy with a padding mask: from batch ~16
on, that copy and the second read cost as much as the projections (docs/bench/cpu-engine.md). This op
walks each sequence's block table instead: one task per (sequence, KV head), the G query heads of that
KV head scored against each cached key row once (scores, then an exact softmax, then the weighted sum of
the value rows), so K and V are read once, in place, and nothing is written but the output.

Off by default: `SPLITSERVE_CPU_ATTN=1` turns it on. It is compiled with
`torch.utils.cpp_extension.load_inline` the first time a CPU engine builds its attention backend (about
30-60 s on 2 cores, once per host: torch caches the build under `~/.cache/torch_extensions`, or
`TORCH_EXTENSIONS_DIR`), which a first `splitserve serve` should not pay, and at the endpoint it has not
yet been shown faster than the gather (docs/bench/cpu-engine.md). Off, without a C++ compiler or ninja,
`load()` answers None and the caller keeps the gather + SDPA path.
The sums run in another order than SDPA's (fp32 either way): outputs differ by ~1e-7 relative.
"""

from __future__ import annotations

import logging
import os
import threading

import torch

log = logging.getLogger(__name__)

ENABLED = os.environ.get("SPLITSERVE_CPU_ATTN", "0") == "1"  # off by default: see the docstring
_NAME = "splitserve_cpu_attn_v1"

_SOURCE = r"""
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <torch/library.h>
#include <algorithm>
#include <cmath>
#include <vector>

// q [B, H, D] contiguous; k_cache, v_cache [NB, BS, KVH, D] (rows of D contiguous, any other strides);
// tables [B, MB] int64; lens [B] int64; -> [B, H, D]. Query head h reads KV head h / (H / KVH).
static at::Tensor paged_decode(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                               const at::Tensor& tables, const at::Tensor& lens, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "paged_decode: fp32 only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "paged_decode: shapes");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1, "paged_decode: rows must be contiguous");
  const auto qc = q.contiguous();
  const auto tab = tables.to(at::kLong).contiguous();
  const auto len = lens.to(at::kLong).contiguous();
  const int64_t B = qc.size(0), H = qc.size(1), D = qc.size(2);
  const int64_t BS = k_cache.size(1), KVH = k_cache.size(2), MB = tab.size(1);
  TORCH_CHECK(H % KVH == 0 && k_cache.size(3) == D, "paged_decode: heads");
  const int64_t G = H / KVH;
  auto out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  const float sc = static_cast<float>(scale);
  at::parallel_for(0, B * KVH, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, acc(G * D);
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / KVH, h = i % KVH, L = lp[b];
      const float* qb = qp + (b * H + h * G) * D;
      float* ob = op + (b * H + h * G) * D;
      if (L <= 0) {
        std::fill(ob, ob + G * D, 0.f);
        continue;
      }
      s.resize(G * L);
      for (int64_t t = 0; t < L; ++t) {  // scores: each key row read once for the G heads
        const float* kr = kp + tp[b * MB + t / BS] * kb + (t % BS) * kt + h * kh;
        for (int64_t g = 0; g < G; ++g) {
          const float* qg = qb + g * D;
          float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
          int64_t d = 0;
          for (; d + 8 <= D; d += 8)
            for (int j = 0; j < 8; ++j) part[j] += qg[d + j] * kr[d + j];
          float dot = ((part[0] + part[1]) + (part[2] + part[3])) +
                      ((part[4] + part[5]) + (part[6] + part[7]));
          for (; d < D; ++d) dot += qg[d] * kr[d];
          s[g * L + t] = dot * sc;
        }
      }
      std::vector<float> inv(G);
      for (int64_t g = 0; g < G; ++g) {  // softmax per head
        float* sg = s.data() + g * L;
        const float mx = *std::max_element(sg, sg + L);
        float sum = 0.f;
        for (int64_t t = 0; t < L; ++t) {
          sg[t] = std::exp(sg[t] - mx);
          sum += sg[t];
        }
        inv[g] = 1.f / sum;
      }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t t = 0; t < L; ++t) {  // weighted sum: each value row read once for the G heads
        const float* vr = vp + tp[b * MB + t / BS] * vb + (t % BS) * vt + h * vh;
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * L + t];
          float* a = acc.data() + g * D;
          for (int64_t d = 0; d < D; ++d) a[d] += p * vr[d];
        }
      }
      for (int64_t g = 0; g < G; ++g)
        for (int64_t d = 0; d < D; ++d) ob[g * D + d] = acc[g * D + d] * inv[g];
    }
  });
  return out;
}

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, float scale)"
        " -> Tensor");
}
TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
"""

_lock = threading.Lock()
_state: dict[str, object] = {}


def _flags() -> list[str]:
    flags = ["-O3", "-fno-math-errno"]
    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512"):
        flags += ["-mavx2", "-mfma"]
    return flags


def load(force: bool = False) -> object | None:
    """The op (`torch.ops.splitserve_cpu.paged_decode`), built and loaded once per process; None where
    it is off (the default: `SPLITSERVE_CPU_ATTN=1` turns it on, `force` builds it regardless, for its
    tests) or cannot be built (the reason is logged once)."""
    with _lock:
        if "op" in _state:
            return _state["op"]
        if not (ENABLED or force):
            return None
        op = None
        try:
            from torch.utils.cpp_extension import load_inline

            name = _NAME + ("_avx2" if "-mavx2" in _flags() else "")
            load_inline(name, cpp_sources=[_SOURCE], extra_cflags=_flags(), is_python_module=False)
            op = torch.ops.splitserve_cpu.paged_decode
        except Exception as e:  # no compiler, no ninja, a failed build: keep the torch path
            log.warning("CPU paged attention kernel unavailable (%s); gathering KV instead", e)
        _state["op"] = op
        return op


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:
    op = _state.get("op")
    assert op is not None, "call load() first"
    return op(q, k_cache, v_cache, block_tables, context_lens, scale)  # type: ignore[operator]
