"""A decode step's decoder layer as one C++ call on CPU fp32: the same ops, in the same order, without
Python between them.

In a decode-only step of a few rows every op is short: at one row the 30 layers' projections read the
weights in ~22 ms, and the ~9 op calls a layer spent ~4 ms more in Python and torch's dispatch
(`bench/profile_cpu_step.py --prompts 1`). This op runs one layer's sequence from C++ through
torch's dispatcher: the QKV panels (kernels/cpu/gemm.py), q/k norm + rotary + KV store (kernels/cpu/fused.py),
the paged decode attention (kernels/cpu/attention.py), the output panels, the residual add + RMSNorm, the
gate/up panels, SiLU-and-multiply, the down panels and the next residual add + RMSNorm: the calls of
`DecoderLM._forward_cpu_fused`, so that the outputs are bitwise the same (tests/engine/test_cpu_layer.py).
With `cpu_weights: int4` the projections are torch's int4 kernel, called as `cpu_linear.Int4Matmul` calls
it (bf16 activations, fp32 out).

Used by `DecoderLM._forward_cpu_fused` (while `DecoderLM.cpu_layer`) for steps where every row decodes
(one decode group, no prefill) in at most `cpu_gemm.MAX_ROWS` rows, the four projections of every layer
are all fp32 with panels or all int4, and the ops' libraries are loaded. Built on first use like them
(kernels/cpu/build.py); `SPLITSERVE_CPU_LAYER=0` turns it off (an A/B switch). Measured
(docs/bench/cpu-engine.md): batch 1 22.4 against 27.5 ms a step, int4 9.0-9.2 against 11.8-12.1 ms.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from splitserve.kernels.cpu import attention as cpu_attention
from splitserve.kernels.cpu import fused as cpu_fused
from splitserve.kernels.cpu import gemm as cpu_gemm
from splitserve.kernels.cpu import linear as cpu_linear
from splitserve.kernels.cpu.build import CppOps

ENABLED = os.environ.get("SPLITSERVE_CPU_LAYER", "1") != "0"

_SOURCE = r"""
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <ATen/ops/_weight_int4pack_mm_for_cpu.h>
#include <torch/library.h>
#include <optional>
#include <tuple>

using T = at::Tensor;
using Opt = std::optional<at::Tensor>;

static T panel(const T& x, const T& panels, int64_t n, const Opt& bias) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("splitserve_cpu_gemm::panel_mm", "")
                       .typed<T(const T&, const T&, int64_t, const Opt&)>();
  return op.call(x, panels, n, bias);
}

static T add_norm(const T& x, const T& residual, const T& weight, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("splitserve_cpu_fused::add_rms_norm", "")
                       .typed<T(const T&, const T&, const T&, double)>();
  return op.call(x, residual, weight, eps);
}

static T silu_mul(const T& x) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("splitserve_cpu_fused::silu_mul", "")
                       .typed<T(const T&)>();
  return op.call(x);
}

static std::tuple<T, T> rope_store(const T& qkv, const T& positions, const T& cos, const T& sin,
                                   const T& k_cache, const T& v_cache, const T& slots, int64_t H,
                                   int64_t KVH, const T& q_norm, const T& k_norm, double eps) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("splitserve_cpu_fused::rope_store", "")
                       .typed<std::tuple<T, T>(const T&, const T&, const T&, const T&, const T&, const T&,
                                               const T&, int64_t, int64_t, const T&, const T&, double)>();
  return op.call(qkv, positions, cos, sin, k_cache, v_cache, slots, H, KVH, q_norm, k_norm, eps);
}

static T paged_decode(const T& q, const T& k_cache, const T& v_cache, const T& tables, const T& lens,
                      double scale) {
  static auto op = c10::Dispatcher::singleton()
                       .findSchemaOrThrow("splitserve_cpu::paged_decode", "")
                       .typed<T(const T&, const T&, const T&, const T&, const T&, double)>();
  return op.call(q, k_cache, v_cache, tables, lens, scale);
}

// projection i of a layer: fp32 panels (w[i]), or int4 codes (w[2i], scales and offsets w[2i + 1]:
// kernels/cpu/linear.py's Int4Matmul, bf16 activations, fp32 out)
static T project(const T& x, bool int4, at::TensorList w, int64_t i, int64_t n, const Opt& bias) {
  if (!int4) return panel(x, w[i], n, bias);
  T out = at::_weight_int4pack_mm_for_cpu(x.to(at::kBFloat16), w[2 * i], 32, w[2 * i + 1]).to(at::kFloat);
  return bias.has_value() ? out.add(*bias) : out;
}

// h [B, hidden] (the layer's input, normed); residual [B, hidden], updated in place -> the next norm's
// output. `w`: the qkv, o, gate_up and down projections (`project`); `n`: their output sizes; `norms`:
// q_norm, k_norm (empty: none), post-attention norm, the next norm; `eps`: qk, post, next.
static T decode_layer(const T& h, const T& residual, const T& positions, const T& slots, const T& tables,
                      const T& lens, const T& cos, const T& sin, const T& k_cache, const T& v_cache,
                      at::TensorList w, at::IntArrayRef n, const Opt& qkv_bias, at::TensorList norms,
                      at::ArrayRef<double> eps, int64_t H, int64_t KVH, double scale) {
  const bool int4 = w.size() == 8;
  TORCH_CHECK((w.size() == 4 || int4) && n.size() == 4 && norms.size() == 4 && eps.size() == 3,
              "decode_layer: args");
  const int64_t B = h.size(0), D = k_cache.size(3);
  const T qkv = project(h, int4, w, 0, n[0], qkv_bias);
  auto [q, k] = rope_store(qkv, positions, cos, sin, k_cache, v_cache, slots, H, KVH, norms[0], norms[1],
                           eps[0]);
  const T attn = paged_decode(q, k_cache, v_cache, tables, lens, scale).view({B, H * D});
  const T a = project(attn, int4, w, 1, n[1], std::nullopt);
  const T hp = add_norm(a, residual, norms[2], eps[1]);
  const T m = project(silu_mul(project(hp, int4, w, 2, n[2], std::nullopt)), int4, w, 3, n[3], std::nullopt);
  return add_norm(m, residual, norms[3], eps[2]);
}

TORCH_LIBRARY(splitserve_cpu_layer, m) {
  m.def("decode_layer(Tensor h, Tensor residual, Tensor positions, Tensor slots, Tensor tables, Tensor lens,"
        " Tensor cos, Tensor sin, Tensor k_cache, Tensor v_cache, Tensor[] w, int[] n, Tensor? qkv_bias,"
        " Tensor[] norms, float[] eps, int H, int KVH, float scale) -> Tensor");
}
TORCH_LIBRARY_IMPL(splitserve_cpu_layer, CPU, m) { m.impl("decode_layer", &decode_layer); }
"""

LIB = CppOps("splitserve_cpu_layer_v2", _SOURCE, ["-O2"], ENABLED, "CPU decode layer op")
_NONE = torch.empty(0)


def start() -> bool:
    """For an engine: True where the op is on (built in the background; `ready()` says when)."""
    return LIB.start()


def ready() -> bool:
    """The op and the libraries of the norm, rotary and attention ops it calls are loaded (the panels'
    library, where a layer has them: `layer_args`)."""
    return LIB.ready() and cpu_fused.ready() and cpu_attention.ready()


def load(force: bool = False) -> bool:
    """Build (or find) and load the op and the libraries it calls (`force`: regardless of the switches;
    tests, benches)."""
    deps = cpu_gemm.load(force) and cpu_fused.load(force) and cpu_attention.load(force) is not None
    return deps and LIB.load(force)


def layer_args(layer: Any, next_norm: Any) -> tuple | None:
    """The constant arguments of `decode_layer` for a `decoder.DecoderLayer` whose next norm is
    `next_norm` (an RMSNorm): (w, n, qkv_bias, norms, eps, H, KVH); None unless the four projections
    are all int4 or all fp32 with panels (and the panels' op loaded), or where the layer has a bias the
    op does not take."""
    attn, mlp = layer.self_attn, layer.mlp
    projs = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    mats = [getattr(p, "cpu_matmul", None) for p in projs]
    if all(isinstance(m, cpu_linear.Int4Matmul) for m in mats):
        w = [t for m in mats for t in (m.packed, m.scales_zeros)]
    elif cpu_gemm.ready() and all(
        isinstance(m, cpu_linear.OneDNNMatmul) and m.panels is not None for m in mats
    ):
        w = [m.panels for m in mats]
    else:
        return None
    if any(m.bias is not None for m in mats[1:]):
        return None
    qn = attn.q_norm.weight if attn.q_norm is not None else _NONE
    kn = attn.k_norm.weight if attn.k_norm is not None else _NONE
    qk_eps = attn.q_norm.eps if attn.q_norm is not None else 0.0
    post = layer.post_attention_layernorm
    n = [p.out_features for p in projs]
    return (
        w, n, mats[0].bias,
        [qn, kn, post.weight, next_norm.weight], [qk_eps, post.eps, next_norm.eps], attn.h, attn.kvh,
    )  # fmt: skip


def decode_layer(
    h: torch.Tensor,  # [B, hidden], the layer's normed input
    residual: torch.Tensor,  # [B, hidden], updated in place
    dyn: tuple,  # positions, slots, tables, lens, cos, sin
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    args: tuple,  # from layer_args
    scale: float,
) -> torch.Tensor:
    """One layer of a decode-only step -> the next layer's normed input (the final norm's after the last)."""
    return torch.ops.splitserve_cpu_layer.decode_layer(h, residual, *dyn, k_cache, v_cache, *args, scale)


__all__ = ["decode_layer", "layer_args", "load", "ready", "start"]
