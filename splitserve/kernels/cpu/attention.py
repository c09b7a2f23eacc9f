"""CPU decode attention that reads the paged KV blocks where they are (a small C++ op, built on first use).

The torch path (`attention.TorchPagedAttention._decode`) gathers every sequence's blocks into a fresh
[B, KVH, L, D] copy for K and for V, then runs SDPA over the copy with a padding mask: from batch ~16
on, that copy and the second read cost as much as the projections (docs/bench/cpu-engine.md). This op
walks each sequence's block table instead, block by block: the block's key rows scored against the query
heads (each row read from memory once, for all the heads of its task), an exact softmax per head, then
the value rows weighted into registers; nothing is written but the output. One task per sequence (all
its KV heads: a block's rows are read whole) when there are at least two per thread, else one per
(sequence, KV head). With AVX2 and FMA the inner loops are intrinsics (a vectorized exp, software
prefetch of the next block: the pool scatters a sequence's blocks, so the hardware prefetchers lose the
trail at every block); elsewhere the same loops in scalar C++. On an AVX-512 host, head_dim 64 or 128
goes to the body of kernels/cpu/attention_avx512.py instead (1.15-1.2x at 64 rows of the default model).

On by default for CPU engines (`start()`; `SPLITSERVE_CPU_ATTN=0` turns it off): it is compiled by
the host's C++ compiler (~15-20 s on 2 cores) in a background thread at the first engine start, the
engine gathering meanwhile, and cached (kernels/cpu/build.py); later starts load it in well under a
second. Without a compiler, or where the build fails, `load()` answers None and the engine keeps the
gather + SDPA path.
The sums run in another order than SDPA's (fp32 either way): outputs differ by ~1e-7 relative.
"""

from __future__ import annotations

import os

import torch

from splitserve.kernels.cpu import attention_avx512 as cpu_attention_avx512
from splitserve.kernels.cpu.build import AVX512_HEADER, SIMD_HEADER, CppOps, simd_flags

ENABLED = os.environ.get("SPLITSERVE_CPU_ATTN", "1") != "0"  # on by default; 0 turns it off
_NAME = "splitserve_cpu_attn_v7"
# the AVX-512 body (kernels/cpu/attention_avx512.py) where torch reports AVX-512 on this host;
# SPLITSERVE_CPU_ATTN_AVX512=0 keeps the AVX2 body (bench/cpu_attention_op.py --avx2 compares them)
_AVX512 = (
    torch.backends.cpu.get_cpu_capability() == "AVX512"
    and os.environ.get("SPLITSERVE_CPU_ATTN_AVX512") != "0"
)

_HEAD = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty_like.h>
#include <torch/library.h>
#include <algorithm>
#include <atomic>
#include <cmath>
#include <vector>
// the rows of one block (n token rows `rstride` apart, nh heads `hstride` apart, d floats each) into
// the cache ahead of their use: a sequence's blocks lie anywhere in the pool, so the hardware
// prefetchers lose the trail at each block and a plain walk waits on memory (perf: most of the time)
static inline void prefetch_block(const float* base, int64_t n, int64_t nh, int64_t d, int64_t rstride,
                                  int64_t hstride) {
#ifdef SS_AVX2
  for (int64_t j = 0; j < n; ++j)
    for (int64_t h = 0; h < nh; ++h)
      for (int64_t c = 0; c < d; c += 16)
        _mm_prefetch(reinterpret_cast<const char*>(base + j * rstride + h * hstride + c), _MM_HINT_T0);
#endif
}

struct Task {  // one sequence, KV heads [h0, h0 + nh): their nh * G query heads over its L cached rows
  const float* q;  // [nh * G, D]
  float* out;      // [nh * G, D]
  const int64_t* table;
  int64_t L, nh, G, D, BS;
  const float* k;  // head h0's row 0 of block 0 (+ table[i] * kb + row * kt + head * kh)
  const float* v;
  int64_t kb, kt, kh, vb, vt, vh;
  float scale;
};
"""

_BODY = r"""
#ifdef SS_AVX2
// the dot products of one query row with 8 key rows `kt` apart (D % 8 == 0), as one vector: 8
// independent FMA chains (the query chunk loaded once for all 8), then one transposing reduction
// instead of a horizontal sum per row
static inline __m256 dot8(const float* q, const float* k, int64_t kt, int64_t D) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0, a4 = a0, a5 = a0, a6 = a0, a7 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 x = _mm256_loadu_ps(q + d);
    a0 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + d), a0);
    a1 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + kt + d), a1);
    a2 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 2 * kt + d), a2);
    a3 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 3 * kt + d), a3);
    a4 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 4 * kt + d), a4);
    a5 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 5 * kt + d), a5);
    a6 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 6 * kt + d), a6);
    a7 = _mm256_fmadd_ps(x, _mm256_loadu_ps(k + 7 * kt + d), a7);
  }
  // hadd twice: [r0 r1 r2 r3 | r0' r1' r2' r3'] (each lane half of a row's sum), then lanes to rows
  const __m256 t0 = _mm256_hadd_ps(_mm256_hadd_ps(a0, a1), _mm256_hadd_ps(a2, a3));
  const __m256 t1 = _mm256_hadd_ps(_mm256_hadd_ps(a4, a5), _mm256_hadd_ps(a6, a7));
  return _mm256_add_ps(_mm256_permute2f128_ps(t0, t1, 0x20), _mm256_permute2f128_ps(t0, t1, 0x31));
}
#endif

// body(rows, t0, n) for each of the task's blocks in order (`cache`: the K or V cache; cb, ct, ch: its
// block, row and head strides; rows: the block's first row; t0: its first position; n: its rows), the
// next block's rows prefetched before the body reads this one's
template <class Body>
static inline void each_block(const Task& a, const float* cache, int64_t cb, int64_t ct, int64_t ch,
                              Body body) {
  const int64_t nblk = (a.L + a.BS - 1) / a.BS;
  prefetch_block(cache + a.table[0] * cb, std::min(a.BS, a.L), a.nh, a.D, ct, ch);
  for (int64_t blk = 0, t0 = 0; blk < nblk; ++blk, t0 += a.BS) {
    if (blk + 1 < nblk)
      prefetch_block(cache + a.table[blk + 1] * cb, std::min(a.BS, a.L - t0 - a.BS), a.nh, a.D, ct, ch);
    body(cache + a.table[blk] * cb, t0, std::min(a.BS, a.L - t0));
  }
}

// scores s[p * L + t] = scale * q_p . k_t (p = head * G + g), block by block: a block's rows are read
// from memory once (the first query head) and from L1 for the others
static void scores(const Task& a, float* s) {
  each_block(a, a.k, a.kb, a.kt, a.kh, [&](const float* base, int64_t t0, int64_t n) {
    for (int64_t h = 0; h < a.nh; ++h)
      for (int64_t g = 0; g < a.G; ++g) {
        const float* qg = a.q + (h * a.G + g) * a.D;
        float* sp = s + (h * a.G + g) * a.L + t0;
        int64_t j = 0;
#ifdef SS_AVX2
        if (a.D % 8 == 0)
          for (; j + 8 <= n; j += 8) {
            const float* kr = base + j * a.kt + h * a.kh;
            _mm256_storeu_ps(sp + j, _mm256_mul_ps(dot8(qg, kr, a.kt, a.D), _mm256_set1_ps(a.scale)));
          }
#endif
        for (; j < n; ++j) {
          const float* kr = base + j * a.kt + h * a.kh;
          float dot = 0.f;
          int64_t d = 0;
#ifdef SS_AVX2
          __m256 x0 = _mm256_setzero_ps(), x1 = _mm256_setzero_ps();
          for (; d + 16 <= a.D; d += 16) {
            x0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kr + d), x0);
            x1 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d + 8), _mm256_loadu_ps(kr + d + 8), x1);
          }
          for (; d + 8 <= a.D; d += 8)
            x0 = _mm256_fmadd_ps(_mm256_loadu_ps(qg + d), _mm256_loadu_ps(kr + d), x0);
          dot = hsum8(_mm256_add_ps(x0, x1));
#endif
          for (; d < a.D; ++d) dot += qg[d] * kr[d];
          sp[j] = dot * a.scale;
        }
      }
  });
}

// s_p <- exp(s_p - max s_p) in place; -> 1 / sum
static float softmax_row(float* sp, int64_t L) {
  float mx = *std::max_element(sp, sp + L), sum = 0.f;
  int64_t t = 0;
#ifdef SS_AVX2
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; t + 8 <= L; t += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(sp + t), m));
    _mm256_storeu_ps(sp + t, e);
    acc = _mm256_add_ps(acc, e);
  }
  sum = hsum8(acc);
#endif
  for (; t < L; ++t) {
    sp[t] = std::exp(sp[t] - mx);
    sum += sp[t];
  }
  return 1.f / sum;
}

// acc_p += sum over the block's n rows of p[j] * v_j (D floats), in registers within the block
static inline void accumulate(float* acc, const float* p, const float* v, int64_t n, int64_t vt, int64_t D) {
  int64_t d0 = 0;
#ifdef SS_AVX2
  for (; d0 + 64 <= D; d0 += 64) {
    float* o = acc + d0;
    __m256 r0 = _mm256_loadu_ps(o), r1 = _mm256_loadu_ps(o + 8), r2 = _mm256_loadu_ps(o + 16),
           r3 = _mm256_loadu_ps(o + 24), r4 = _mm256_loadu_ps(o + 32), r5 = _mm256_loadu_ps(o + 40),
           r6 = _mm256_loadu_ps(o + 48), r7 = _mm256_loadu_ps(o + 56);
    for (int64_t j = 0; j < n; ++j) {
      const float* vr = v + j * vt + d0;
      const __m256 w = _mm256_set1_ps(p[j]);
      r0 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr), r0);
      r1 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 8), r1);
      r2 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 16), r2);
      r3 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 24), r3);
      r4 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 32), r4);
      r5 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 40), r5);
      r6 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 48), r6);
      r7 = _mm256_fmadd_ps(w, _mm256_loadu_ps(vr + 56), r7);
    }
    _mm256_storeu_ps(o, r0);
    _mm256_storeu_ps(o + 8, r1);
    _mm256_storeu_ps(o + 16, r2);
    _mm256_storeu_ps(o + 24, r3);
    _mm256_storeu_ps(o + 32, r4);
    _mm256_storeu_ps(o + 40, r5);
    _mm256_storeu_ps(o + 48, r6);
    _mm256_storeu_ps(o + 56, r7);
  }
  for (; d0 + 8 <= D; d0 += 8) {
    __m256 r = _mm256_loadu_ps(acc + d0);
    for (int64_t j = 0; j < n; ++j)
      r = _mm256_fmadd_ps(_mm256_set1_ps(p[j]), _mm256_loadu_ps(v + j * vt + d0), r);
    _mm256_storeu_ps(acc + d0, r);
  }
#endif
  for (int64_t j = 0; j < n; ++j)
    for (int64_t d = d0; d < D; ++d) acc[d] += p[j] * v[j * vt + d];
}

// out_p = inv_p * sum_t s_p[t] v_t, block by block (a block's value rows read from memory once)
static void weighted_sum(const Task& a, const float* s, const float* inv, float* acc) {
  const int64_t P = a.nh * a.G;
  std::fill(acc, acc + P * a.D, 0.f);
  each_block(a, a.v, a.vb, a.vt, a.vh, [&](const float* base, int64_t t0, int64_t n) {
    for (int64_t h = 0; h < a.nh; ++h)
      for (int64_t g = 0; g < a.G; ++g) {
        const int64_t p = h * a.G + g;
        accumulate(acc + p * a.D, s + p * a.L + t0, base + h * a.vh, n, a.vt, a.D);
      }
  });
  for (int64_t p = 0; p < P; ++p)
    for (int64_t d = 0; d < a.D; ++d) a.out[p * a.D + d] = acc[p * a.D + d] * inv[p];
}

#ifdef SS_AVX512
static std::atomic<int64_t> tasks512{0};  // tasks the AVX-512 body took (paged_decode_tasks512)
#endif

// q [B, H, D] contiguous; k_cache, v_cache [NB, BS, KVH, D] (rows of D contiguous, any other strides);
// tables [B, MB] int64; lens [B] int64; -> [B, H, D]. Query head h reads KV head h / (H / KVH).
// One task per sequence (all its KV heads: a block's rows are read whole) when there are enough of
// them for the threads, else one per (sequence, KV head).
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
  const int64_t nh = B >= 2 * at::get_num_threads() ? KVH : 1;  // KV heads per task
  const int64_t per_seq = KVH / nh;
  auto out = at::empty_like(qc);
  const float* qp = qc.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* kp = k_cache.data_ptr<float>();
  const float* vp = v_cache.data_ptr<float>();
  const int64_t* tp = tab.data_ptr<int64_t>();
  const int64_t* lp = len.data_ptr<int64_t>();
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1), kh = k_cache.stride(2);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1), vh = v_cache.stride(2);
  at::parallel_for(0, B * per_seq, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> s, inv(nh * G), acc(nh * G * D);
    [[maybe_unused]] int64_t wide = 0;  // tasks the AVX-512 body took: one shared add a range
    for (int64_t i = begin; i < end; ++i) {
      const int64_t b = i / per_seq, h0 = (i % per_seq) * nh;
      const Task a{qp + (b * H + h0 * G) * D, op + (b * H + h0 * G) * D, tp + b * MB, lp[b], nh, G, D, BS,
                   kp + h0 * kh, vp + h0 * vh, kb, kt, kh, vb, vt, vh, static_cast<float>(scale)};
      if (a.L <= 0) {
        std::fill(a.out, a.out + nh * G * D, 0.f);
        continue;
      }
      s.resize(nh * G * a.L);
#ifdef SS_AVX512
      if (decode_task512(a, s.data(), inv.data(), acc.data())) {
        ++wide;
        continue;
      }
#endif
      scores(a, s.data());
      for (int64_t p = 0; p < nh * G; ++p) inv[p] = softmax_row(s.data() + p * a.L, a.L);
      weighted_sum(a, s.data(), inv.data(), acc.data());
    }
#ifdef SS_AVX512
    if (wide) tasks512.fetch_add(wide, std::memory_order_relaxed);
#endif
  });
  return out;
}

// tasks the AVX-512 body has run in this process (0 where it is not built): for the tests
static int64_t paged_decode_tasks512() {
#ifdef SS_AVX512
  return tasks512.load(std::memory_order_relaxed);
#else
  return 0;
#endif
}

TORCH_LIBRARY(splitserve_cpu, m) {
  m.def("paged_decode(Tensor q, Tensor k_cache, Tensor v_cache, Tensor tables, Tensor lens, float scale)"
        " -> Tensor");
  m.def("paged_decode_tasks512() -> int", &paged_decode_tasks512);
}
TORCH_LIBRARY_IMPL(splitserve_cpu, CPU, m) { m.impl("paged_decode", &paged_decode); }
"""

if _AVX512:
    _SOURCE = SIMD_HEADER + AVX512_HEADER + _HEAD + cpu_attention_avx512.SOURCE + _BODY
    _FLAGS = [*simd_flags(), "-mavx512f", "-mavx512dq"]
else:
    _SOURCE, _FLAGS = SIMD_HEADER + _HEAD + _BODY, simd_flags()

LIB = CppOps(_NAME, _SOURCE, _FLAGS, ENABLED, "CPU paged attention kernel")


def load(force: bool = False) -> object | None:
    """The op (`torch.ops.splitserve_cpu.paged_decode`), built and loaded once per process; None where
    it is off (`SPLITSERVE_CPU_ATTN=0`; `force` builds it regardless, for its tests) or cannot be built
    (the reason is logged once; the engine keeps gathering KV)."""
    return torch.ops.splitserve_cpu.paged_decode if LIB.load(force) else None


def start() -> bool:
    """For an engine: True where the op is on; then it is built (or loaded from torch's cache) in a
    background thread, once per process, and `ready()` says when the engine can use it: a first start
    on a host serves through the gather meanwhile instead of waiting for the compiler."""
    return LIB.start()


def ready() -> bool:
    """Whether the op is built and loaded in this process."""
    return LIB.ready()


def paged_decode(
    q: torch.Tensor,  # [B, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int64
    context_lens: torch.Tensor,  # [B] int64
    scale: float,
) -> torch.Tensor:
    assert LIB.ready(), "call load() first"
    return torch.ops.splitserve_cpu.paged_decode(q, k_cache, v_cache, block_tables, context_lens, scale)
