"""CPU: a block-quantized GGUF's products on AMX, as exact as fp32's, at about twice fp32's rate.

The embedded default model is a Q4_1 GGUF: every projection weight was dequantized from blocks of 32
inputs, `w = d * q + m` with 4-bit codes `q` in 0..15 and fp16 `d`, `m` per block (its LM head, the
tied Q8_0 embedding: `w = d * q`, `q` in -127..127). The fp32 path multiplies by those weights at the
host's FMA rate. This op multiplies by the same blocks without rounding anything:

    x . w_n = sum_b d_nb * (x_b . q_nb) + sum_b m_nb * (sum of x_b)

- the codes are exact in bf16, so `x_b . q_nb` runs on AMX (`tdpbf16ps`, one tile op a block of 32:
  a bf16 tile row is one block) with x split into three bf16 limbs, `x = xh + xm + xl` exactly (8 + 8
  + 8 bits of fp32's 24). Each limb's products with the codes are exact, summed in fp32 in the tile;
- each block's tile is scaled by `d` and summed into fp32 accumulators (AVX-512), the offsets' term
  is one small fp32 product over the block sums (K / 32 inputs).

The only roundings are fp32 sums, as in any fp32 product: against an fp64 reference the error is
~3e-7 of the largest output, below oneDNN's fp32 (~9e-7) over the same weights
(`tests/model/test_cpu_amx.py`). The blocks are recovered from the dequantized fp32 weights
(`codes`): a weight takes this op only where every block reproduces it bit for bit, so random fp32
weights (the HF parity tests) keep the fp32 path.

Used by `cpu_linear.OneDNNMatmul` for a layer's products of `MIN_ROWS` rows or more and for the LM
head's of any size, where the host has AMX-BF16 and the kernel grants the tile state
(`arch_prctl(ARCH_REQ_XCOMP_PERM)`). `bench/cpu_amx_op.py` measures it against the fp32 paths over
the default model's weights (docs/bench/cpu-engine.md): 1.2-1.6x oneDNN's fp32 at 1,024
rows, 1.3-1.8x the panels at 32-128; at 1-8 rows the small projections run slower than the panels,
the head (its codes half fp32's bytes) 1.5-2.2x faster. A decode step of `MIN_ROWS` rows or more
leaves kernels/cpu/layer.py's op for the Python path, whose products come here. Memory: the codes as
bf16, half the fp32 weight's bytes, beside the other layouts; recovering the blocks adds ~0.7 s to a
worker's start. `SPLITSERVE_CPU_AMX=0` turns it off.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from splitserve.kernels.cpu.build import CppOps

ENABLED = os.environ.get("SPLITSERVE_CPU_AMX", "1") != "0"
MIN_ROWS = int(os.environ.get("SPLITSERVE_CPU_AMX_ROWS", "32"))  # a layer's products: below, the panels
HEAD_MIN_ROWS = 1  # the LM head from one row: its codes are half fp32's bytes and N is large
BLOCK = 32  # inputs per block: Q4_0/Q4_1/Q8_0's, and one bf16 tile row

_SOURCE = r"""
#include <torch/library.h>
#include <ATen/ATen.h>
#include <ATen/Parallel.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <algorithm>

// the kernel's leave to use the tile registers (Linux 5.16+): ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA
static bool amx_init() {
  static const bool ok = syscall(SYS_arch_prctl, 0x1023, 18) == 0;
  return ok;
}

struct TileConfig { uint8_t palette, start; uint8_t reserved[14]; uint16_t colsb[16]; uint8_t rows[16]; };

// every tile 16 rows of 64 bytes: 0-1 sums (fp32), 2-4 x's limbs (bf16), 5-6 codes (bf16 pairs)
static inline void configure_tiles() {
  TileConfig c{};
  c.palette = 1;
  for (int t = 0; t < 7; ++t) { c.rows[t] = 16; c.colsb[t] = 64; }
  _tile_loadconfig(&c);
}

// x [M, K] fp32 -> (limbs [ceil(M / 16), K / 32, 3, 16, 32] bf16, zero rows past M; sums [M, K / 32]
// fp32 of each block): a tile's three limbs lie together, so that each loads as 1 KB at once
static std::tuple<at::Tensor, at::Tensor> split(const at::Tensor& x) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat && x.is_contiguous() && x.size(1) % 32 == 0,
              "amx split: x [M, K] contiguous fp32, K a multiple of 32");
  const int64_t M = x.size(0), K = x.size(1), NB = K / 32, MT = (M + 15) / 16;
  auto limbs = at::empty({MT, NB, 3, 16, 32}, x.options().dtype(at::kBFloat16));
  auto sums = at::empty({M, NB}, x.options());
  const float* X = x.data_ptr<float>();
  uint16_t* L = reinterpret_cast<uint16_t*>(limbs.data_ptr());
  float* S = sums.data_ptr<float>();
  at::parallel_for(0, MT, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t t = t0; t < t1; ++t)
      for (int r = 0; r < 16; ++r) {
        const int64_t row = t * 16 + r;
        for (int64_t b = 0; b < NB; ++b) {
          uint16_t* dst = L + ((t * NB + b) * 3 * 16 + r) * 32;
          for (int h = 0; h < 2; ++h) {
            __m512 v = row < M ? _mm512_loadu_ps(X + row * K + b * 32 + 16 * h) : _mm512_setzero_ps();
            if (row < M && h == 0) S[row * NB + b] = 0.f;
            if (row < M) S[row * NB + b] += _mm512_reduce_add_ps(v);
            for (int l = 0; l < 3; ++l) {  // round to bf16, keep the exact remainder
              const __m256bh p = _mm512_cvtneps_pbh(v);
              _mm256_storeu_si256(reinterpret_cast<__m256i*>(dst + l * 16 * 32 + 16 * h), (__m256i)p);
              v = _mm512_sub_ps(v, _mm512_cvtpbh_ps(p));
            }
          }
        }
      }
  });
  return {limbs, sums};
}

// out [M, N] fp32 (+)= sum over blocks b of d[b, n] * (x_b . q_nb): limbs from `split`, codes
// [N / 16, K / 32, 16, 32] bf16 (tile B: input pairs by rows, output n's pair at 2n), d [K / 32, N]
// fp32. `accumulate`: out holds a term to add to (the offsets'), else it is written.
static void mm(const at::Tensor& limbs, const at::Tensor& codes, const at::Tensor& d, at::Tensor& out,
               bool accumulate) {
  const int64_t M = out.size(0), N = out.size(1), NB = d.size(0), MT = limbs.size(0);
  TORCH_CHECK(N % 32 == 0 && d.size(1) == N && codes.size(0) == N / 16 && codes.size(1) == NB &&
              limbs.size(1) == NB && MT == (M + 15) / 16, "amx mm: shapes");
  const uint16_t* A = reinterpret_cast<const uint16_t*>(limbs.data_ptr());
  const uint16_t* Bq = reinterpret_cast<const uint16_t*>(codes.data_ptr());
  const float* D = d.data_ptr<float>();
  float* O = out.data_ptr<float>();
  constexpr int64_t MB = 4;  // row tiles whose limbs stay in L2 while a thread's codes pass by
  at::parallel_for(0, N / 32, 1, [&](int64_t p0, int64_t p1) {
    configure_tiles();
    alignas(64) float buf[2][256];
    for (int64_t mb = 0; mb < MT; mb += MB)
      for (int64_t p = p0; p < p1; ++p)
        for (int64_t t = mb; t < std::min(MT, mb + MB); ++t) {
          const int64_t rows = std::min<int64_t>(16, M - t * 16), n0 = p * 32;
          __m512 acc0[16], acc1[16];
          for (int r = 0; r < 16; ++r) {
            const bool load = accumulate && r < rows;
            acc0[r] = load ? _mm512_loadu_ps(O + (t * 16 + r) * N + n0) : _mm512_setzero_ps();
            acc1[r] = load ? _mm512_loadu_ps(O + (t * 16 + r) * N + n0 + 16) : _mm512_setzero_ps();
          }
          for (int64_t b = 0; b < NB; ++b) {
            const uint16_t* a = A + (t * NB + b) * 3 * 512;
            _tile_zero(0);
            _tile_zero(1);
            _tile_loadd(5, Bq + (2 * p * NB + b) * 512, 64);
            _tile_loadd(6, Bq + ((2 * p + 1) * NB + b) * 512, 64);
            _tile_loadd(2, a + 2 * 512, 64);  // the smallest limb first
            _tile_loadd(3, a + 512, 64);
            _tile_loadd(4, a, 64);
            _tile_dpbf16ps(0, 2, 5);
            _tile_dpbf16ps(1, 2, 6);
            _tile_dpbf16ps(0, 3, 5);
            _tile_dpbf16ps(1, 3, 6);
            _tile_dpbf16ps(0, 4, 5);
            _tile_dpbf16ps(1, 4, 6);
            _tile_stored(0, buf[0], 64);
            _tile_stored(1, buf[1], 64);
            const __m512 d0 = _mm512_loadu_ps(D + b * N + n0), d1 = _mm512_loadu_ps(D + b * N + n0 + 16);
            for (int r = 0; r < 16; ++r) {
              acc0[r] = _mm512_fmadd_ps(_mm512_load_ps(buf[0] + 16 * r), d0, acc0[r]);
              acc1[r] = _mm512_fmadd_ps(_mm512_load_ps(buf[1] + 16 * r), d1, acc1[r]);
            }
          }
          for (int r = 0; r < rows; ++r) {
            _mm512_storeu_ps(O + (t * 16 + r) * N + n0, acc0[r]);
            _mm512_storeu_ps(O + (t * 16 + r) * N + n0 + 16, acc1[r]);
          }
        }
    _tile_release();
  });
}

static at::Tensor matmul(const at::Tensor& x, const at::Tensor& codes, const at::Tensor& d,
                         const c10::optional<at::Tensor>& m) {
  TORCH_CHECK(amx_init(), "amx: the kernel refused the tile state");
  auto [limbs, sums] = split(x);
  at::Tensor out;
  if (m.has_value()) {
    out = at::mm(sums, *m);  // the offsets' term: [M, K / 32] @ [K / 32, N]
  } else {
    out = at::empty({x.size(0), d.size(1)}, x.options());
  }
  mm(limbs, codes, d, out, m.has_value());
  return out;
}

TORCH_LIBRARY(splitserve_cpu_amx, m) {
  m.def("init() -> bool", &amx_init);
  m.def("matmul(Tensor x, Tensor codes, Tensor d, Tensor? m) -> Tensor");
}
TORCH_LIBRARY_IMPL(splitserve_cpu_amx, CPU, m) { m.impl("matmul", &matmul); }
"""


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def supported() -> bool:
    """AMX-BF16 and AVX512-BF16 on this host (Linux, which grants tiles on request)."""
    return {"amx_bf16", "amx_tile", "avx512_bf16", "avx512f"} <= _cpu_flags()


FLAGS = ["-O3", "-mavx512f", "-mavx512bf16", "-mavx512vl", "-mamx-tile", "-mamx-bf16"]
LIB = CppOps("splitserve_cpu_amx_v1", _SOURCE, FLAGS, ENABLED and supported(), "the CPU AMX block op")


def start() -> bool:
    """Build or load the op in the background where it is on and the host has AMX."""
    return LIB.start()


def load(force: bool = False) -> bool:
    """Load the op now (`force`: even where it is switched off); False where it cannot run here."""
    return LIB.load(force) and bool(torch.ops.splitserve_cpu_amx.init())


_granted: bool | None = None


def ready() -> bool:
    """Whether the op is loaded and the kernel granted the tile state."""
    global _granted
    if not LIB.ready():
        return False
    if _granted is None:
        _granted = bool(torch.ops.splitserve_cpu_amx.init())
    return _granted


@dataclass
class Blocks:
    """A weight [N, K] as `w = d * q + m` per block of 32 inputs, laid out for the op."""

    codes: torch.Tensor  # [N / 16, K / 32, 16, 32] bf16: tile B's layout (input pairs by rows)
    d: torch.Tensor  # [K / 32, N] fp32
    m: torch.Tensor | None  # [K / 32, N] fp32; None for a symmetric format (Q8_0)
    n: int


def blocks(weight: torch.Tensor) -> Blocks | None:
    """The weight's blocks where it was dequantized from 32-input blocks with fp16 scales (and
    offsets) that reproduce it bit for bit: Q4_1 (`d * q + m`, q in 0..15, the block's least weight
    m and largest m + 15 d) or Q8_0 (`d * q`, the largest |q| 127); else None. N must be a multiple
    of 32. Each format is tried on the first 32 rows before the whole weight (random fp32 weights
    are turned down at once)."""
    n, k = weight.shape
    if weight.dtype != torch.float32 or n % 32 or k % BLOCK or n * k == 0:
        return None
    with torch.no_grad():
        b = weight.detach().reshape(n, k // BLOCK, BLOCK)
        for signed in (False, True):
            if _recover(b[:32], signed) is not None:
                found = _recover(b, signed)
                if found is not None:
                    q, d, m = found
                    codes = q.to(torch.bfloat16).view(n // 16, 16, k // BLOCK, 16, 2)
                    codes = codes.permute(0, 2, 3, 1, 4).contiguous()  # [NT, NB, pair, n, 2]
                    return Blocks(codes, d.t().contiguous(), None if m is None else m.t().contiguous(), n)
    return None


def _recover(b: torch.Tensor, signed: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None] | None:
    """[N, K / 32, 32] fp32 -> (codes, d, m or None) [N, K / 32, ...] that give b exactly, or None."""
    lo, hi = torch.aminmax(b, dim=-1)
    if signed:
        d, off = (torch.maximum(-lo, hi) / 127).half().float(), None
    else:
        d, off = ((hi - lo) / 15).half().float(), lo
    if not torch.isfinite(d).all():
        return None
    inv = torch.where(d > 0, 1 / d, torch.zeros_like(d))[..., None]
    q = (b - off[..., None]).mul_(inv) if off is not None else b * inv
    q = q.round_().clamp_(-128 if signed else 0, 127 if signed else 15)
    back = q * d[..., None]
    if off is not None:
        back += off[..., None]
    return (q, d, off) if torch.equal(back, b) else None


def matmul(x: torch.Tensor, w: Blocks, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., K] fp32 @ W.T (+ bias) through the op."""
    flat = x.reshape(-1, x.shape[-1])
    flat = flat if flat.is_contiguous() else flat.contiguous()
    out = torch.ops.splitserve_cpu_amx.matmul(flat, w.codes, w.d, w.m)
    out = out.view(*x.shape[:-1], w.n)
    return out if bias is None else out + bias


__all__ = ["HEAD_MIN_ROWS", "MIN_ROWS", "Blocks", "blocks", "load", "matmul", "ready", "start", "supported"]
