"""CPU fp32: the decoder's small per-layer work as single C++ ops (built on first use, kernels/cpu/build.py).

Between its projections, a dense decoder layer runs two RMSNorms, two residual adds, the rotary
embedding of q and k and the KV store. In torch each is several ops (`F.rms_norm` is a composite of
six on CPU), ~25 a layer and 750 a step for the default model: at batch 1 ~5 ms of a ~33 ms decode step
is their dispatch, and in a 2,048-token prefill they are passes over memory that one pass can do.
Three ops replace them and the MLP's activation (the CPU analogue of kernels/fused.py's Triton
kernels), and a fourth the sampler's draw:

- `add_rms_norm(x, residual, weight, eps)`: `residual += x` in place (skipped when `residual` is
  empty), then `weight * (r * rsqrt(mean(r^2) + eps))` of it into a fresh tensor, row by row;
- `silu_mul(x)`: the MLP's `silu(gate) * up` from its merged gate/up output, into a contiguous tensor
  (the torch path's product is a strided view that oneDNN copies before the down projection);
- `rope_store(qkv, positions, cos, sin, k_cache, v_cache, slots, q_norm, k_norm, eps)`: from the QKV
  projection's output, q and k (each head RMS-normed first where the model has q/k norms: Qwen3) rotated
  with the neox rotary embedding, returned as fresh [T, H, D] and [T, KVH, D] tensors, while k and v
  are written into the paged cache at the slots;
- `sample_rows(x, temps, u)`: the sampler's inverse-CDF draw (engine/sampler.py) over the logits
  themselves, without its [N, V] probabilities, fp64 cumsum and search (fresh tensors whose pages fault
  in each step: ~31 ms of a batch-64 decode step at temperature 1, now ~3.5 ms).

Arithmetic: the same operations as the torch path in the same order, compiled with
`-ffp-contract=off` (no fused multiply-adds), so the rotary embedding and the norm's products are
bit-identical to it; the norm's sum of squares runs in another order than `torch.mean`'s (16
partial sums), and SiLU's exp is the paged decode op's (Cephes, ~1 ulp, where torch uses Sleef's):
~1e-7 relative. Greedy output stays token-exact with HF (`tests/engine/test_hf_parity.py`).
`SPLITSERVE_CPU_FUSED=0` turns them off (an A/B switch).
"""

from __future__ import annotations

import os

import torch

from splitserve.kernels.cpu.build import SIMD_HEADER, CppOps, simd_flags

ENABLED = os.environ.get("SPLITSERVE_CPU_FUSED", "1") != "0"

_SOURCE = (
    SIMD_HEADER
    + r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/empty.h>
#include <torch/library.h>
#include <cmath>
#include <tuple>
#include <vector>

// 1 / sqrt(mean(x^2) + eps) of n floats: 16 independent partial sums (vector lanes), then in order
static inline float inv_rms(const float* x, int64_t n, float eps) {
  float acc[16] = {0.f};
  int64_t i = 0;
  for (; i + 16 <= n; i += 16)
    for (int j = 0; j < 16; ++j) acc[j] += x[i + j] * x[i + j];
  float s = 0.f;
  for (int j = 0; j < 16; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i] * x[i];
  return 1.f / std::sqrt(s / static_cast<float>(n) + eps);
}

// out = w * (x * r), HF's order: the normed row first, then the weight
static inline void scale_row(const float* x, const float* w, float r, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) out[i] = w[i] * (x[i] * r);
}

static at::Tensor add_rms_norm(const at::Tensor& x, const at::Tensor& residual, const at::Tensor& weight,
                               double eps) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && weight.scalar_type() == at::kFloat, "add_rms_norm: fp32");
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1 && weight.is_contiguous(), "add_rms_norm: x [T, N] rows");
  const bool add = residual.numel() > 0;
  TORCH_CHECK(!add || (residual.sizes() == x.sizes() && residual.is_contiguous() &&
                       residual.scalar_type() == at::kFloat), "add_rms_norm: residual [T, N] contiguous");
  const int64_t T = x.size(0), N = x.size(1);
  TORCH_CHECK(weight.numel() == N, "add_rms_norm: weight");
  auto out = at::empty({T, N}, x.options());
  const float* xp = x.data_ptr<float>();
  float* rp = add ? residual.data_ptr<float>() : nullptr;
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const int64_t xs = x.stride(0), grain = std::max<int64_t>(1, 16384 / N);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, grain, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* src = xp + t * xs;
      if (add) {
        float* r = rp + t * N;
        for (int64_t i = 0; i < N; ++i) r[i] += src[i];
        src = r;
      }
      scale_row(src, wp, inv_rms(src, N, e), op + t * N, N);
    }
  });
  return out;
}

// one head of D floats: optionally RMS-normed (q/k norm), then rotated by (c, s) of D / 2 each
static inline void rope_head(const float* x, const float* nw, float eps, const float* c, const float* s,
                             float* out, int64_t D) {
  float tmp[512];
  if (nw != nullptr) {
    scale_row(x, nw, inv_rms(x, D, eps), tmp, D);
    x = tmp;
  }
  const int64_t h = D / 2;
  for (int64_t i = 0; i < h; ++i) {
    out[i] = x[i] * c[i] - x[h + i] * s[i];
    out[h + i] = x[h + i] * c[i] + x[i] * s[i];
  }
}

static std::tuple<at::Tensor, at::Tensor> rope_store(
    const at::Tensor& qkv, const at::Tensor& positions, const at::Tensor& cos, const at::Tensor& sin,
    const at::Tensor& k_cache, const at::Tensor& v_cache, const at::Tensor& slots, int64_t H, int64_t KVH,
    const at::Tensor& q_norm, const at::Tensor& k_norm, double eps) {
  TORCH_CHECK(qkv.scalar_type() == at::kFloat && cos.scalar_type() == at::kFloat &&
              sin.scalar_type() == at::kFloat && k_cache.scalar_type() == at::kFloat &&
              v_cache.scalar_type() == at::kFloat, "rope_store: fp32");
  TORCH_CHECK(qkv.dim() == 2 && qkv.stride(1) == 1, "rope_store: qkv [T, (H + 2 KVH) D] rows");
  const int64_t T = qkv.size(0), D = k_cache.size(3), BS = k_cache.size(1);
  TORCH_CHECK(qkv.size(1) == (H + 2 * KVH) * D && D % 2 == 0 && D <= 512, "rope_store: head size");
  TORCH_CHECK(k_cache.size(2) == KVH && v_cache.size(2) == KVH && k_cache.stride(3) == 1 &&
              v_cache.stride(3) == 1 && k_cache.stride(2) == D && v_cache.stride(2) == D,
              "rope_store: cache [blocks, block_size, KVH, D] with contiguous token rows");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.size(1) == D, "rope_store: tables");
  const bool qn = q_norm.numel() > 0, kn = k_norm.numel() > 0;
  TORCH_CHECK((!qn || q_norm.numel() == D) && (!kn || k_norm.numel() == D), "rope_store: q/k norm");
  const auto pos = positions.to(at::kLong).contiguous();
  const auto slot = slots.to(at::kLong).contiguous();
  TORCH_CHECK(pos.numel() == T && slot.numel() == T, "rope_store: positions and slots");
  auto q = at::empty({T, H, D}, qkv.options());
  auto k = at::empty({T, KVH, D}, qkv.options());
  const float* xp = qkv.data_ptr<float>();
  const int64_t* pp = pos.data_ptr<int64_t>();
  const int64_t* sp = slot.data_ptr<int64_t>();
  const float *cp = cos.data_ptr<float>(), *snp = sin.data_ptr<float>();
  const float* qw = qn ? q_norm.data_ptr<float>() : nullptr;
  const float* kw = kn ? k_norm.data_ptr<float>() : nullptr;
  float *qp = q.data_ptr<float>(), *kp = k.data_ptr<float>();
  float *kc = k_cache.data_ptr<float>(), *vc = v_cache.data_ptr<float>();
  const int64_t xs = qkv.stride(0), cs = cos.stride(0);
  const int64_t kb = k_cache.stride(0), kt = k_cache.stride(1);
  const int64_t vb = v_cache.stride(0), vt = v_cache.stride(1);
  const float e = static_cast<float>(eps);
  at::parallel_for(0, T, 8, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float* row = xp + t * xs;
      const float* c = cp + pp[t] * cs;  // the first half of the row (the halves are equal)
      const float* s = snp + pp[t] * cs;
      for (int64_t h = 0; h < H; ++h) rope_head(row + h * D, qw, e, c, s, qp + (t * H + h) * D, D);
      float* krow = kp + t * KVH * D;
      for (int64_t h = 0; h < KVH; ++h) rope_head(row + (H + h) * D, kw, e, c, s, krow + h * D, D);
      const int64_t blk = sp[t] / BS, off = sp[t] % BS;
      std::copy(krow, krow + KVH * D, kc + blk * kb + off * kt);
      const float* v = row + (H + KVH) * D;
      std::copy(v, v + KVH * D, vc + blk * vb + off * vt);
    }
  });
  return {q, k};
}

// out = silu(g) * u of x = [g | u] (the MLP's merged gate/up output) into a fresh contiguous tensor;
// silu(g) from e = exp(-|g|), which cannot overflow: g / (1 + e) for g >= 0, g e / (1 + e) below
static at::Tensor silu_mul(const at::Tensor& x) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1 && x.size(1) % 2 == 0,
              "silu_mul: x [T, 2 I] fp32 rows");
  const int64_t T = x.size(0), I = x.size(1) / 2, xs = x.stride(0);
  auto out = at::empty({T, I}, x.options());
  const float* xp = x.data_ptr<float>();
  float* op = out.data_ptr<float>();
  at::parallel_for(0, T, std::max<int64_t>(1, 16384 / I), [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const float *g = xp + t * xs, *u = g + I;
      float* o = op + t * I;
      int64_t i = 0;
#ifdef SS_AVX2
      const __m256 one = _mm256_set1_ps(1.f), zero = _mm256_setzero_ps(), sign = _mm256_set1_ps(-0.f);
      for (; i + 8 <= I; i += 8) {
        const __m256 v = _mm256_loadu_ps(g + i);
        const __m256 e = exp8(_mm256_or_ps(v, sign));  // exp(-|v|)
        const __m256 num = _mm256_blendv_ps(v, _mm256_mul_ps(v, e), _mm256_cmp_ps(v, zero, _CMP_LT_OQ));
        const __m256 silu = _mm256_div_ps(num, _mm256_add_ps(one, e));
        _mm256_storeu_ps(o + i, _mm256_mul_ps(silu, _mm256_loadu_ps(u + i)));
      }
#endif
      for (; i < I; ++i) o[i] = g[i] / (1.f + std::exp(-g[i])) * u[i];
    }
  });
  return out;
}

// the sampler's draw (engine/sampler.py): per row of x [N, V], the token drawn from softmax(x / t) by
// inverse CDF with the row's uniform number u in [0, 1): the first token whose running sum of
// exp(x / t - max) (fp64) passes u times the row's total; t == 0: the row's first maximum instead.
// A token at -inf (filtered out) has weight 0 and is never drawn. The weights are kept in a row buffer
// with fp64 sums of each 64 tokens, so the search reads the chunk sums and then one chunk.
static at::Tensor sample_rows(const at::Tensor& x, const at::Tensor& temps, const at::Tensor& u) {
  TORCH_CHECK(x.scalar_type() == at::kFloat && x.dim() == 2 && x.stride(1) == 1,
              "sample_rows: x [N, V] fp32 rows");
  const int64_t N = x.size(0), V = x.size(1), xs = x.stride(0), C = 64, nc = (V + C - 1) / C;
  const auto tt = temps.to(at::kFloat).contiguous();
  const auto uu = u.to(at::kDouble).contiguous();
  TORCH_CHECK(tt.numel() == N && uu.numel() == N && V > 0, "sample_rows: temps and u [N]");
  auto out = at::empty({N}, x.options().dtype(at::kLong));
  const float* xp = x.data_ptr<float>();
  const float* tp = tt.data_ptr<float>();
  const double* up = uu.data_ptr<double>();
  int64_t* op = out.data_ptr<int64_t>();
  at::parallel_for(0, N, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> w(nc * C, 0.f);
    std::vector<double> part(nc);
    for (int64_t r = begin; r < end; ++r) {
      const float* row = xp + r * xs;
      const float t = tp[r];
      int64_t best = 0;
      for (int64_t j = 1; j < V; ++j)
        if (row[j] > row[best]) best = j;
      if (t == 0.f) {
        op[r] = best;
        continue;
      }
      const float m = row[best] / t;  // division rounds monotonically: the max of x / t
      if (!std::isfinite(m)) {  // +inf (that token is the limit), or every token at -inf or NaN
        op[r] = best;
        continue;
      }
      double total = 0.;
      for (int64_t c = 0; c < nc; ++c) {
        const int64_t lo = c * C, hi = std::min(V, lo + C);
        int64_t j = lo;
        double s = 0.;
#ifdef SS_AVX2
        const __m256 tv = _mm256_set1_ps(t), mv = _mm256_set1_ps(m), ninf = _mm256_set1_ps(-INFINITY);
        __m256d s0 = _mm256_setzero_pd(), s1 = s0;
        for (; j + 8 <= hi; j += 8) {
          const __m256 v = _mm256_loadu_ps(row + j);
          const __m256 e = _mm256_and_ps(exp8(_mm256_sub_ps(_mm256_div_ps(v, tv), mv)),
                                         _mm256_cmp_ps(v, ninf, _CMP_NEQ_OQ));
          _mm256_storeu_ps(w.data() + j, e);
          s0 = _mm256_add_pd(s0, _mm256_cvtps_pd(_mm256_castps256_ps128(e)));
          s1 = _mm256_add_pd(s1, _mm256_cvtps_pd(_mm256_extractf128_ps(e, 1)));
        }
        double lanes[4];
        _mm256_storeu_pd(lanes, _mm256_add_pd(s0, s1));
        s = (lanes[0] + lanes[1]) + (lanes[2] + lanes[3]);
#endif
        for (; j < hi; ++j) {
          w[j] = row[j] == -INFINITY ? 0.f : std::exp(row[j] / t - m);
          s += w[j];
        }
        part[c] = s;
        total += s;
      }
      if (!(total > 0.)) {  // no weight (NaN logits beside the max): the first max
        op[r] = best;
        continue;
      }
      const double target = up[r] * total;
      double run = 0.;
      int64_t c = 0, last = -1;  // last: the last chunk with weight, where rounding leaves the target
      for (; c < nc; ++c) {
        if (part[c] > 0.) last = c;
        if (run + part[c] > target) break;
        run += part[c];
      }
      if (c == nc) c = last;
      int64_t pick = -1;
      for (int64_t j = c * C, hi = std::min(V, j + C); j < hi; ++j) {
        if (w[j] <= 0.f) continue;
        pick = j;
        run += w[j];
        if (run > target) break;
      }
      op[r] = pick < 0 ? best : pick;
    }
  });
  return out;
}

TORCH_LIBRARY(splitserve_cpu_fused, m) {
  m.def("add_rms_norm(Tensor x, Tensor residual, Tensor weight, float eps) -> Tensor");
  m.def("silu_mul(Tensor x) -> Tensor");
  m.def("sample_rows(Tensor x, Tensor temps, Tensor u) -> Tensor");
  m.def("rope_store(Tensor qkv, Tensor positions, Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache,"
        " Tensor slots, int H, int KVH, Tensor q_norm, Tensor k_norm, float eps) -> (Tensor, Tensor)");
}
TORCH_LIBRARY_IMPL(splitserve_cpu_fused, CPU, m) {
  m.impl("add_rms_norm", &add_rms_norm);
  m.impl("rope_store", &rope_store);
  m.impl("silu_mul", &silu_mul);
  m.impl("sample_rows", &sample_rows);
}
"""
)

LIB = CppOps("splitserve_cpu_fused_v2", _SOURCE, [*simd_flags(), "-ffp-contract=off"], ENABLED,
             "CPU fused norm/rotary ops")  # fmt: skip
_NONE = torch.empty(0)


def start() -> bool:
    """For an engine: True where the ops are on (built in the background; `ready()` says when)."""
    return LIB.start()


def ready() -> bool:
    return LIB.ready()


def load(force: bool = False) -> bool:
    return LIB.load(force)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x [T, N] (rows contiguous); residual [T, N] contiguous, updated in place to residual + x, or
    None -> RMSNorm(residual + x or x) * weight, a fresh [T, N] tensor."""
    res = _NONE if residual is None else residual
    return torch.ops.splitserve_cpu_fused.add_rms_norm(x, res, weight, eps)


def rope_store(
    qkv: torch.Tensor,  # [T, (H + 2 KVH) * D]
    positions: torch.Tensor,  # [T]
    cos: torch.Tensor,  # [max_positions, D] (two equal halves)
    sin: torch.Tensor,
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    slots: torch.Tensor,  # [T]
    heads: tuple[int, int],  # (H, KVH)
    qk_norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,  # (q weight, k weight, eps)
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (q [T, H, D], k [T, KVH, D]) normed (if `qk_norm`) and rotated; k and v stored at `slots`."""
    qn, kn, eps = qk_norm if qk_norm is not None else (_NONE, _NONE, 0.0)
    return torch.ops.splitserve_cpu_fused.rope_store(
        qkv, positions, cos, sin, k_cache, v_cache, slots, heads[0], heads[1], qn, kn, eps
    )


def silu_mul(x: torch.Tensor) -> torch.Tensor:
    """x [T, 2 I] = [gate | up] (rows contiguous) -> silu(gate) * up, a fresh contiguous [T, I]."""
    return torch.ops.splitserve_cpu_fused.silu_mul(x)


def sample_rows(x: torch.Tensor, temps: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """x [N, V] fp32 logits (rows contiguous; -inf: filtered out), temps [N] (0: greedy), u [N] fp64 in
    [0, 1) -> [N] int64: each row's token drawn from softmax(x / t) by inverse CDF with its u, or its
    first maximum where t is 0. In place of softmax, an fp64 cumsum and a search over fresh [N, V]
    tensors (engine/sampler.py's torch path), ~30 ms at 64 rows of 49,152, most of it page faults."""
    return torch.ops.splitserve_cpu_fused.sample_rows(x, temps, u)
