"""The AVX-512 body of the CPU paged decode op (kernels/cpu/attention.py), for hosts that have it.

The AVX2 body scores one query head at a time against 8 key rows, reads each value row once per query
head, and keeps the weighted sums in memory between blocks: on an AVX-512 host, hot in cache, it ran
at ~0.94 ms a layer for 64 sequences of 288 tokens (the default model), as long as reading that
layer's 28 MB of KV from memory, so that the two added up to ~1.5 ms (`bench/cpu_attention_op.py --avx2`).

This body does the same arithmetic in 16-lane vectors, with fewer instructions between the loads:
- scores: 16 key rows at a time against one query head, one FMA chain a row over the head's D
  floats, then one transposing reduction of the 16 chains (45 shuffles and adds for 16 scores,
  where a horizontal sum a row costs ~8);
- weighted values: the G query heads of a KV head at once, in registers across a block's rows, so that
  each value row is loaded once for all of them;
- prefetch: the block after next into L2, a KV head's rows at a time, spread over this block's reads.
Taken where D is 64 or 128 (4 or 8 vectors a row); other shapes keep the AVX2 body. The sums run in
another order than the AVX2 body's (fp32 either way): outputs differ by ~1e-7 relative.

Compiled only with -mavx512f (attention.py passes it where torch reports AVX512); it defines
SS_AVX512 and `decode_task512` (one task: its scores, softmax and weighted values), which answers false
where it does not take the shape; attention.py counts the tasks it takes (`paged_decode_tasks512`,
which the tests read to know this body ran).
"""

SOURCE = r"""
#ifdef __AVX512F__
#define SS_AVX512 1
// lane j of the result = the sum of a[j]'s 16 lanes (a transposing reduction: 4 levels, each halving
// the vectors, 45 shuffles and adds in all)
static inline __m512 hsum16x16(const __m512* a) {
  __m512 b[8], c[4];
  for (int i = 0; i < 8; ++i)
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i)
    c[i] = _mm512_add_ps(_mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0x44),
                         _mm512_shuffle_ps(b[2 * i], b[2 * i + 1], 0xEE));
  const __m512 d0 =
      _mm512_add_ps(_mm512_shuffle_f32x4(c[0], c[1], 0x88), _mm512_shuffle_f32x4(c[0], c[1], 0xDD));
  const __m512 d1 =
      _mm512_add_ps(_mm512_shuffle_f32x4(c[2], c[3], 0x88), _mm512_shuffle_f32x4(c[2], c[3], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d0, d1, 0x88), _mm512_shuffle_f32x4(d0, d1, 0xDD));
}

// a block's rows of one KV head into L2, SS_AHEAD blocks before their use, a head at a time between
// the reads of this block (a burst of a whole block's lines at once, or into L1, measured slower)
constexpr int64_t SS_AHEAD = 2;
template <int ND>
static inline void ahead_rows(const float* base, int64_t n, int64_t rstride) {
  for (int64_t j = 0; j < n; ++j)
    for (int c = 0; c < ND; ++c)
      _mm_prefetch(reinterpret_cast<const char*>(base + j * rstride + 16 * c), _MM_HINT_T1);
}

// one key row against one query head: ND vectors, one FMA chain
template <int ND>
static inline __m512 dot_row(const __m512* qv, const float* kr) {
  __m512 x = _mm512_mul_ps(qv[0], _mm512_loadu_ps(kr));
  for (int c = 1; c < ND; ++c) x = _mm512_fmadd_ps(qv[c], _mm512_loadu_ps(kr + 16 * c), x);
  return x;
}

// s[p * L + t] = scale * q_p . k_t for the task's nh * G query heads, block by block
template <int ND>
static void scores512(const Task& a, float* s) {
  const int64_t nblk = (a.L + a.BS - 1) / a.BS;
  const __m512 vscale = _mm512_set1_ps(a.scale);
  for (int64_t blk = 0, t0 = 0; blk < nblk; ++blk, t0 += a.BS) {
    const int64_t n = std::min(a.BS, a.L - t0);
    const float* ahead = blk + SS_AHEAD < nblk ? a.k + a.table[blk + SS_AHEAD] * a.kb : nullptr;
    for (int64_t h = 0; h < a.nh; ++h) {
      const float* base = a.k + a.table[blk] * a.kb + h * a.kh;
      if (ahead) ahead_rows<ND>(ahead + h * a.kh, n, a.kt);
      for (int64_t g = 0; g < a.G; ++g) {
        const int64_t p = h * a.G + g;
        __m512 qv[ND];
        for (int c = 0; c < ND; ++c) qv[c] = _mm512_loadu_ps(a.q + p * a.D + 16 * c);
        float* sp = s + p * a.L + t0;
        int64_t j = 0;
        for (; j + 16 <= n; j += 16) {
          __m512 acc[16];
          for (int r = 0; r < 16; ++r) acc[r] = dot_row<ND>(qv, base + (j + r) * a.kt);
          _mm512_storeu_ps(sp + j, _mm512_mul_ps(hsum16x16(acc), vscale));
        }
        for (; j < n; ++j) sp[j] = _mm512_reduce_add_ps(dot_row<ND>(qv, base + j * a.kt)) * a.scale;
      }
    }
  }
}

// acc[g] += sum over the block's n rows of p_g[j] * v_j for GC query heads at once (p_g = s + g * L),
// each value row loaded once for all of them; acc in registers across the rows
template <int ND, int GC>
static inline void weigh_rows(float* acc, const float* s, int64_t L, const float* v, int64_t n, int64_t vt) {
  __m512 o[GC][ND];
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < ND; ++c) o[g][c] = _mm512_loadu_ps(acc + g * ND * 16 + 16 * c);
  for (int64_t j = 0; j < n; ++j) {
    __m512 vv[ND];
    for (int c = 0; c < ND; ++c) vv[c] = _mm512_loadu_ps(v + j * vt + 16 * c);
    for (int g = 0; g < GC; ++g) {
      const __m512 w = _mm512_set1_ps(s[g * L + j]);
      for (int c = 0; c < ND; ++c) o[g][c] = _mm512_fmadd_ps(w, vv[c], o[g][c]);
    }
  }
  for (int g = 0; g < GC; ++g)
    for (int c = 0; c < ND; ++c) _mm512_storeu_ps(acc + g * ND * 16 + 16 * c, o[g][c]);
}

// GC = up to 24 / ND query heads a pass (their sums stay in registers); G split into such passes
template <int ND>
static inline void weigh_heads(float* acc, const float* s, int64_t L, const float* v, int64_t n, int64_t vt,
                               int64_t G) {
  constexpr int64_t MAXC = 24 / ND;
  for (int64_t g0 = 0; g0 < G; g0 += MAXC) {
    float* ag = acc + g0 * ND * 16;
    const float* sg = s + g0 * L;
    switch (std::min(MAXC, G - g0)) {
      case 1: weigh_rows<ND, 1>(ag, sg, L, v, n, vt); break;
      case 2: weigh_rows<ND, 2>(ag, sg, L, v, n, vt); break;
      case 3: weigh_rows<ND, 3>(ag, sg, L, v, n, vt); break;
      case 4: weigh_rows<ND, (4 <= MAXC ? 4 : 1)>(ag, sg, L, v, n, vt); break;
      case 5: weigh_rows<ND, (5 <= MAXC ? 5 : 1)>(ag, sg, L, v, n, vt); break;
      default: weigh_rows<ND, (6 <= MAXC ? 6 : 1)>(ag, sg, L, v, n, vt); break;
    }
  }
}

// out_p = inv_p * sum_t s_p[t] v_t, block by block
template <int ND>
static void weighted_sum512(const Task& a, const float* s, const float* inv, float* acc) {
  const int64_t P = a.nh * a.G, nblk = (a.L + a.BS - 1) / a.BS;
  std::fill(acc, acc + P * a.D, 0.f);
  for (int64_t blk = 0, t0 = 0; blk < nblk; ++blk, t0 += a.BS) {
    const int64_t n = std::min(a.BS, a.L - t0);
    const float* base = a.v + a.table[blk] * a.vb;
    const float* ahead = blk + SS_AHEAD < nblk ? a.v + a.table[blk + SS_AHEAD] * a.vb : nullptr;
    for (int64_t h = 0; h < a.nh; ++h) {
      if (ahead) ahead_rows<ND>(ahead + h * a.vh, n, a.vt);
      weigh_heads<ND>(acc + h * a.G * a.D, s + h * a.G * a.L + t0, a.L, base + h * a.vh, n, a.vt, a.G);
    }
  }
  for (int64_t p = 0; p < P; ++p) {
    const __m512 w = _mm512_set1_ps(inv[p]);
    for (int64_t d = 0; d < a.D; d += 16)
      _mm512_storeu_ps(a.out + p * a.D + d, _mm512_mul_ps(w, _mm512_loadu_ps(acc + p * a.D + d)));
  }
}

static inline float softmax_row512(float* sp, int64_t L) {
  __m512 mv = _mm512_set1_ps(-INFINITY);
  int64_t t = 0;
  for (; t + 16 <= L; t += 16) mv = _mm512_max_ps(mv, _mm512_loadu_ps(sp + t));
  float mx = _mm512_reduce_max_ps(mv);
  for (int64_t u = t; u < L; ++u) mx = std::max(mx, sp[u]);
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (t = 0; t + 16 <= L; t += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(sp + t), m));
    _mm512_storeu_ps(sp + t, e);
    acc = _mm512_add_ps(acc, e);
  }
  if (t < L) {
    const __mmask16 k = static_cast<__mmask16>((1u << (L - t)) - 1);
    const __m512 e = _mm512_maskz_mov_ps(k, exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(k, sp + t), m)));
    _mm512_mask_storeu_ps(sp + t, k, e);
    acc = _mm512_add_ps(acc, e);
  }
  return 1.f / _mm512_reduce_add_ps(acc);
}

// one task (a sequence's KV heads [h0, h0 + nh)); s holds nh * G * L floats, acc nh * G * D.
// -> false where the shape is not one this body takes (D other than 64 or 128)
static bool decode_task512(const Task& a, float* s, float* inv, float* acc) {
  if (a.D != 64 && a.D != 128) return false;
  if (a.D == 64) scores512<4>(a, s); else scores512<8>(a, s);
  for (int64_t p = 0; p < a.nh * a.G; ++p) inv[p] = softmax_row512(s + p * a.L, a.L);
  if (a.D == 64) weighted_sum512<4>(a, s, inv, acc); else weighted_sum512<8>(a, s, inv, acc);
  return true;
}
#endif
"""
