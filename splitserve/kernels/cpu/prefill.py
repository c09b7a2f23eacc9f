"""CPU prompt attention over the paged KV cache, with AVX-512 (a small C++ op, built on first use).

The torch path (`attention.TorchPagedAttention._attend_fresh`) copies each prompt's K and V once per
query head (`repeat_interleave`: SDPA's CPU kernel wants equal head counts) and runs SDPA, whose CPU
kernel computes every score of a 256-token prompt's square (its key blocks are 512 wide) and masks
half of them away: ~1 ms a layer for one 256-token prompt, ~30 ms of a ~290 ms prefill, and ~0.25 s
of a 2,048-token step (docs/bench/cpu-engine.md). A later chunk of a long prompt first gathers all
its earlier K/V from the cache (`_prefill`).

This op reads the chunk's keys and values where they are (the cache holds them: they are stored
before attention), for any chunk, first or later. A task is one KV head and a tile of query rows:
the tile's rows times the head's G query heads make 64 lanes, or 48 where that aligns the tile's rows
with the 16-key groups (G <= 64; 16 rows of 48 lanes for the default model's G = 3, 1.24x its 21 rows
of 64), kept transposed (d-major), so that every step below is a vector over the lanes:
16 keys at a time, their scores against all lanes (a key's element broadcast, four keys per pass),
the causal mask, an online softmax (running max and sum per lane, exp in AVX-512) and the weighted
values into a d-major accumulator. Keys past a tile's last row are never read; tiles are ordered
so that both threads get equal shares of the triangle.

Only with AVX-512 (F, DQ): elsewhere `ready()` stays False and SDPA serves. On by default for CPU
engines where the host has it; `SPLITSERVE_CPU_PREFILL_ATTN=0` turns it off. The sums run in another
order than SDPA's (fp32 either way): outputs differ by ~1e-6 relative; greedy output stays
token-exact with HF (`tests/engine/test_hf_parity.py`).
"""

from __future__ import annotations

import os

import torch

from splitserve.kernels.cpu.build import AVX512_HEADER, SIMD_HEADER, CppOps

ENABLED = os.environ.get("SPLITSERVE_CPU_PREFILL_ATTN", "1") != "0"

_SOURCE = (
    SIMD_HEADER
    + AVX512_HEADER
    + r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <immintrin.h>
#include <algorithm>
#include <cmath>
#include <vector>

constexpr int MAX_LANES = 64;  // (query row, head) pairs a task: 4 vectors of 16, or 3 (`vectors_for`)
constexpr int KG = 16;       // keys a group

struct Chunk {
  const float* q;  // [T, H, D] rows `qs` apart
  float* out;      // [T, H, D] contiguous
  const float *k, *v;
  const int64_t* table;
  int64_t T, ctx, H, G, D, BS, qs, kb, kt, kh, vb, vt, vh;
  float scale;
};

// one KV head `h` and query rows [r0, r0 + rows): lane l is row r0 + l / G, query head h * G + l % G;
// NV vectors of 16 lanes
template <int NV>
static void tile(const Chunk& c, int64_t h, int64_t r0, int64_t rows) {
  constexpr int LANES = 16 * NV;
  const int64_t D = c.D, G = c.G, first = c.ctx - c.T;  // position of query row 0
  alignas(64) float qt[256 * LANES];  // [D][LANES], pre-scaled
  alignas(64) float acc[256 * LANES];  // [D][LANES]
  alignas(64) float s[KG * LANES];     // [key][LANES]
  alignas(64) float pos[LANES];
  const int64_t used = rows * G;
  for (int64_t l = 0; l < LANES; ++l) {
    const bool on = l < used;
    const int64_t r = r0 + (on ? l / G : 0), hq = h * G + (on ? l % G : 0);
    const float* src = c.q + r * c.qs + hq * D;
    for (int64_t d = 0; d < D; ++d) qt[d * LANES + l] = on ? src[d] * c.scale : 0.f;
    pos[l] = static_cast<float>(first + r);  // unused lanes: row r0's keys, discarded
  }
  std::fill(acc, acc + D * LANES, 0.f);
  __m512 m[NV], sum[NV], P[NV];
  for (int i = 0; i < NV; ++i) {
    m[i] = _mm512_set1_ps(-INFINITY);
    sum[i] = _mm512_setzero_ps();
    P[i] = _mm512_load_ps(pos + 16 * i);
  }
  const int64_t last = first + r0 + rows;  // keys [0, last) are seen by some row of the tile
  alignas(64) float zero[256] = {0.f};
  const float* kr[KG];
  const float* vr[KG];
  for (int64_t j0 = 0; j0 < last; j0 += KG) {
    const int64_t n = std::min<int64_t>(KG, last - j0);
    for (int64_t i = 0; i < KG; ++i) {
      const int64_t j = j0 + i;
      if (i < n) {
        const int64_t b = c.table[j / c.BS], off = j % c.BS;
        kr[i] = c.k + b * c.kb + off * c.kt + h * c.kh;
        vr[i] = c.v + b * c.vb + off * c.vt + h * c.vh;
      } else {
        kr[i] = vr[i] = zero;
      }
    }
    // scores s[i][lanes] = sum_d k_i[d] * qt[d][lanes], four keys a pass
    for (int64_t i0 = 0; i0 < KG; i0 += 4) {
      __m512 a[4][NV];
      for (int u = 0; u < 4; ++u)
        for (int w = 0; w < NV; ++w) a[u][w] = _mm512_setzero_ps();
      for (int64_t d = 0; d < D; ++d) {
        __m512 qv[NV];
        for (int w = 0; w < NV; ++w) qv[w] = _mm512_load_ps(qt + d * LANES + 16 * w);
        for (int u = 0; u < 4; ++u) {
          const __m512 kv = _mm512_set1_ps(kr[i0 + u][d]);
          for (int w = 0; w < NV; ++w) a[u][w] = _mm512_fmadd_ps(kv, qv[w], a[u][w]);
        }
      }
      for (int u = 0; u < 4; ++u)
        for (int w = 0; w < NV; ++w) _mm512_store_ps(s + (i0 + u) * LANES + 16 * w, a[u][w]);
    }
    // causal mask (key j0 + i seen by lanes at positions >= it), the new max, the rescale
    const bool masked = j0 + KG - 1 > first + r0;
    __m512 alpha[NV];
    for (int w = 0; w < NV; ++w) {
      __m512 mx = m[w];
      for (int64_t i = 0; i < n; ++i) {
        __m512 sv = _mm512_load_ps(s + i * LANES + 16 * w);
        if (masked) {
          const __m512 key = _mm512_set1_ps(static_cast<float>(j0 + i));
          const __mmask16 ok = _mm512_cmp_ps_mask(P[w], key, _CMP_GE_OQ);
          sv = _mm512_mask_blend_ps(ok, _mm512_set1_ps(-INFINITY), sv);
          _mm512_store_ps(s + i * LANES + 16 * w, sv);
        }
        mx = _mm512_max_ps(mx, sv);
      }
      // lanes whose max is still -inf (no key yet): keep alpha 1 and exp() of -inf scores at 0 below
      const __mmask16 live = _mm512_cmp_ps_mask(mx, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
      alpha[w] = _mm512_mask_blend_ps(live, _mm512_set1_ps(1.f), exp16(_mm512_sub_ps(m[w], mx)));
      m[w] = mx;
      __m512 tot = _mm512_mul_ps(sum[w], alpha[w]);
      for (int64_t i = 0; i < n; ++i) {
        const __m512 sv = _mm512_load_ps(s + i * LANES + 16 * w);
        const __mmask16 seen = _mm512_cmp_ps_mask(sv, _mm512_set1_ps(-INFINITY), _CMP_NEQ_OQ);
        const __m512 p = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(sv, mx)));
        _mm512_store_ps(s + i * LANES + 16 * w, p);
        tot = _mm512_add_ps(tot, p);
      }
      sum[w] = tot;
    }
    // acc[d][lanes] = alpha * acc[d][lanes] + sum_i v_i[d] * p[i][lanes], four d a pass
    for (int64_t d0 = 0; d0 < D; d0 += 4) {
      __m512 o[4][NV];
      for (int u = 0; u < 4; ++u)
        for (int w = 0; w < NV; ++w)
          o[u][w] = _mm512_mul_ps(_mm512_load_ps(acc + (d0 + u) * LANES + 16 * w), alpha[w]);
      for (int64_t i = 0; i < n; ++i) {
        __m512 p[NV];
        for (int w = 0; w < NV; ++w) p[w] = _mm512_load_ps(s + i * LANES + 16 * w);
        for (int u = 0; u < 4; ++u) {
          const __m512 vv = _mm512_set1_ps(vr[i][d0 + u]);
          for (int w = 0; w < NV; ++w) o[u][w] = _mm512_fmadd_ps(vv, p[w], o[u][w]);
        }
      }
      for (int u = 0; u < 4; ++u)
        for (int w = 0; w < NV; ++w) _mm512_store_ps(acc + (d0 + u) * LANES + 16 * w, o[u][w]);
    }
  }
  alignas(64) float inv[LANES];
  for (int w = 0; w < NV; ++w) _mm512_store_ps(inv + 16 * w, _mm512_div_ps(_mm512_set1_ps(1.f), sum[w]));
  for (int64_t l = 0; l < used; ++l) {
    float* dst = c.out + ((r0 + l / G) * c.H + h * G + l % G) * D;
    for (int64_t d = 0; d < D; ++d) dst[d] = acc[d * LANES + l] * inv[l];
  }
}

// vectors of 16 lanes a task for G query heads a KV head: 4 (64 lanes), or 3 where that makes the
// tile's rows a whole multiple or divisor of a key group's 16 and 4 does not (G = 3: 16 rows, not
// 21; 1.24x on the default model's prompts, docs/bench/cpu-engine.md), or leaves fewer
// lanes idle
static int64_t vectors_for(int64_t G) {
  const auto aligned = [&](int64_t nv) {
    const int64_t rows = 16 * nv / G;
    return rows > 0 && (rows % KG == 0 || KG % rows == 0);
  };
  if (G > 48 || aligned(4)) return 4;
  if (aligned(3)) return 3;
  return (64 % G) * 48 <= (48 % G) * 64 ? 4 : 3;  // the smaller share of idle lanes
}

// q [T, H, D] (rows of D contiguous, heads D apart); caches [NB, BS, KVH, D] (rows contiguous);
// table [MB] int64 -> [T, H, D]: query row r at position ctx - T + r attends to keys [0, ctx - T + r]
static at::Tensor prefill_attention(const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
                                    const at::Tensor& table, int64_t ctx, double scale) {
  TORCH_CHECK(q.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "prefill_attention: fp32 only");
  TORCH_CHECK(q.dim() == 3 && k_cache.dim() == 4 && v_cache.dim() == 4, "prefill_attention: shapes");
  const int64_t T = q.size(0), H = q.size(1), D = q.size(2), KVH = k_cache.size(2), BS = k_cache.size(1);
  TORCH_CHECK(q.stride(2) == 1 && q.stride(1) == D, "prefill_attention: q rows");
  TORCH_CHECK(k_cache.stride(3) == 1 && v_cache.stride(3) == 1 && k_cache.size(3) == D,
              "prefill_attention: cache");
  TORCH_CHECK(H % KVH == 0 && H / KVH <= MAX_LANES && D % 4 == 0 && D <= 256, "prefill_attention: heads");
  TORCH_CHECK(ctx >= T && T > 0, "prefill_attention: context");
  const auto tab = table.to(at::kLong).contiguous();
  TORCH_CHECK(tab.numel() * BS >= ctx, "prefill_attention: block table");
  auto out = at::empty({T, H, D}, q.options());
  const int64_t G = H / KVH, nv = vectors_for(G), rows = 16 * nv / G, tiles = (T + rows - 1) / rows;
  const Chunk c{q.data_ptr<float>(), out.data_ptr<float>(), k_cache.data_ptr<float>(),
                v_cache.data_ptr<float>(), tab.data_ptr<int64_t>(), T, ctx, H, G, D, BS, q.stride(0),
                k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), v_cache.stride(0),
                v_cache.stride(1), v_cache.stride(2), static_cast<float>(scale)};
  // task i: KV head i % KVH, tile order 0, n-1, 1, n-2, ...: a contiguous half of the tasks (one
  // thread's) then holds as many long tiles (late rows) as short ones
  at::parallel_for(0, KVH * tiles, 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      const int64_t h = i % KVH, k = i / KVH, t = k % 2 == 0 ? k / 2 : tiles - 1 - k / 2;
      if (nv == 3)
        tile<3>(c, h, t * rows, std::min(rows, T - t * rows));
      else
        tile<4>(c, h, t * rows, std::min(rows, T - t * rows));
    }
  });
  return out;
}

TORCH_LIBRARY(splitserve_cpu_prefill, m) {
  m.def("prefill_attention(Tensor q, Tensor k_cache, Tensor v_cache, Tensor table, int ctx, float scale)"
        " -> Tensor");
}
TORCH_LIBRARY_IMPL(splitserve_cpu_prefill, CPU, m) { m.impl("prefill_attention", &prefill_attention); }
"""
)


def _supported() -> bool:
    return torch.backends.cpu.get_cpu_capability() == "AVX512"


LIB = CppOps("splitserve_cpu_prefill_v2", _SOURCE, ["-O3", "-fno-math-errno", "-mavx512f", "-mavx512dq"],
             ENABLED and _supported(), "CPU prompt attention kernel")  # fmt: skip


def load(force: bool = False) -> bool:
    """Build (or find) and load the op; False where it is off or the host has no AVX-512 (`force`
    builds it regardless of the switch, for tests and benches, not without AVX-512)."""
    return _supported() and LIB.load(force)


def start() -> bool:
    return LIB.start()


def ready() -> bool:
    return LIB.ready()


def fits(q: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the op takes these shapes: q [T, H, D] with rows of D contiguous and heads D apart,
    H / KVH <= 64 query heads a KV head, D a multiple of 4 up to 256 (the op's checks, answered here so
    that an engine keeps SDPA for another model instead of failing)."""
    d, kvh = q.shape[2], k_cache.shape[2]
    heads_ok = q.shape[1] % kvh == 0 and q.shape[1] // kvh <= 64
    return heads_ok and d % 4 == 0 and d <= 256 and q.stride(2) == 1 and q.stride(1) == d


def prefill_attention(
    q: torch.Tensor,  # [T, H, D]: the chunk's query rows
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D], holding the chunk's keys already
    v_cache: torch.Tensor,
    block_table: torch.Tensor,  # [max_blocks] int64: the sequence's blocks
    context_len: int,  # the chunk's last position + 1
    scale: float,
) -> torch.Tensor:
    """-> [T, H, D]: causal attention of the chunk's rows (positions context_len - T ..) over keys
    [0, position] of the sequence, read from the cache in place."""
    op = torch.ops.splitserve_cpu_prefill.prefill_attention
    return op(q, k_cache, v_cache, block_table, context_len, scale)
