"""Qwen3.5's Gated DeltaNet layer (linear attention) over the flat batch: decode rows by the recurrent
form (fused Triton kernels on CUDA, in place on the state pools), prefill chunks by the chunked rule
(one varlen conv launch and one fla call per layer for all of a step's chunks on CUDA, gdn_prefill.py;
one chunk at a time by the torch rule elsewhere). See qwen3_5.py for the layer's math and state layout.
"""

from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.attention import AttentionMetadata
from splitserve.model.config import ModelConfig
from splitserve.model.decoder import ForwardContext
from splitserve.model.gated_delta import chunk_gated_delta_rule, recurrent_gated_delta_rule
from splitserve.model.gdn_prefill import varlen_conv, varlen_rule
from splitserve.model.layers import GatedRMSNorm, Linear

if TYPE_CHECKING:
    from splitserve.kernels.gemv import NormedRow

# Set to 1 to run the decode kernels on CPU tensors too (with TRITON_INTERPRET=1: kernel tests only).
TRITON_ON_CPU_ENV = "SPLITSERVE_TRITON_INTERPRET_TEST"


@functools.cache
def _decode_kernels() -> ModuleType | None:
    """splitserve.kernels.gated_delta, imported on first use; None without triton."""
    try:
        from splitserve.kernels import gated_delta
    except ImportError:
        return None
    return gated_delta


def _fused_decode_wanted(x: torch.Tensor) -> bool:
    """Whether decode rows should take the fused Triton kernels (if triton is installed): on CUDA, or
    anywhere when TRITON_ON_CPU_ENV is 1. Otherwise the torch path, which on CPU is token-exact with
    HF transformers."""
    return x.is_cuda or os.environ.get(TRITON_ON_CPU_ENV) == "1"


class GatedDeltaNet(nn.Module):
    """Linear-attention layer over the flat batch, reading and writing per-sequence state slots."""

    def __init__(self, cfg: ModelConfig, linear_index: int) -> None:
        super().__init__()
        lin = cfg.linear
        assert lin is not None
        self.index = linear_index  # this layer's index in the state tensors
        self.hk, self.hv, self.dk, self.dv = (
            lin.num_key_heads,
            lin.num_value_heads,
            lin.key_head_dim,
            lin.value_head_dim,
        )
        self.conv_dim, self.kernel = lin.conv_dim, lin.conv_kernel
        self.value_dim = self.hv * self.dv
        # rows: q, k, v (conv_dim) | z (value_dim) | b (Hv) | a (Hv)
        self.in_proj = Linear(cfg.hidden_size, self.conv_dim + self.value_dim + 2 * self.hv, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, self.kernel, groups=self.conv_dim, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.zeros(self.hv))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps)
        self.out_proj = Linear(self.value_dim, cfg.hidden_size, bias=False)
        self.fused = False  # set by Qwen3_5LM.enable_fused_kernels (CUDA)
        self.varlen = False  # set by Qwen3_5LM.set_linear_attention_backend("fla")

    def forward(self, x: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        return self.out_proj(self.mix(x, ctx))

    def mix(self, x: torch.Tensor | NormedRow, ctx: ForwardContext) -> torch.Tensor:
        """The gated-normed rule output [T, value_dim], out_proj's input. `x` may be a `NormedRow`
        (the fused batch-1 path: in_proj's GEMV normalizes it as it reads it)."""
        meta = ctx.meta
        assert meta.seq_slots is not None, "hybrid model run without state slots"
        conv_states = ctx.states["conv"][:, self.index]  # [num_slots, conv_dim, kernel - 1] (a view)
        rec_states = ctx.states["recurrent"][:, self.index]  # [num_slots, Hv, Dk, Dv] (a view)
        mixed, z, b, a = self.in_proj(x).split([self.conv_dim, self.value_dim, self.hv, self.hv], dim=-1)
        t, nd = mixed.shape[0], meta.num_decode_tokens
        kernels = _decode_kernels() if nd and _fused_decode_wanted(mixed) else None
        lp = ctx.linear_prefill if self.varlen else None  # all prefill chunks in one launch (CUDA)
        # the decode rows, and without the varlen path every row: conv, then the rule, into core
        rows = nd if lp is not None else t
        conv_out = self._conv_rows(mixed, conv_states, meta, kernels, rows)  # [rows, conv_dim]
        hk, dk, hv, dv = self.hk, self.dk, self.hv, self.dv
        q, k, v = conv_out.split([hk * dk, hk * dk, self.value_dim], dim=-1)
        q, k, v = q.view(rows, hk, dk), k.view(rows, hk, dk), v.view(rows, hv, dv)
        core = None
        if lp is not None:  # the prefill rows: conv output straight into contiguous q | k | v
            pq, pk, pv, normed = varlen_conv(lp, mixed, conv_states, self.conv1d.weight, hk * dk, dk)
            pq, pk, pv = pq.view(-1, hk, dk), pk.view(-1, hk, dk), pv.view(-1, hv, dv)
            o = varlen_rule(lp, pq, pk, pv, a, b, self.A_log, self.dt_bias, rec_states, normed)
            core = o  # [Tp, Hv, Dv]: all of core in a step without decode rows
            if nd:
                core = o.new_empty((t, hv, dv))
                core[nd:] = o
        if rows:
            core = core if core is not None else v.new_empty((t, hv, dv))
            self._rule_rows(q, k, v, a[:rows], b[:rows], rec_states, meta, kernels, core)
        assert core is not None
        if self.fused:  # one kernel, reading the gate z in place
            from splitserve.kernels.fused import gated_rmsnorm

            return gated_rmsnorm(core.view(t, -1), z, self.norm.weight, self.norm.eps)
        core = self.norm(core.reshape(-1, self.dv), z.reshape(-1, self.dv))  # [T * Hv, Dv]
        return core.reshape(t, self.value_dim)

    def _conv_rows(
        self,
        mixed: torch.Tensor,
        conv_states: torch.Tensor,
        meta: AttentionMetadata,
        kernels: ModuleType | None,
        rows: int,
    ) -> torch.Tensor:
        """silu(causal conv) of the first `rows` rows of mixed [T, conv_dim] (the decode rows, then
        the prefill chunks one by one), continuing and updating each sequence's conv window."""
        nd = meta.num_decode_tokens
        conv_out = mixed.new_empty((rows, self.conv_dim))
        for span in meta.decode_spans() if nd else ():  # one token of each sequence at a time
            slots = meta.seq_slots[span]
            if kernels is not None:  # in place on the state pool, written straight into conv_out
                kernels.causal_conv1d_update(
                    mixed[span], conv_states, self.conv1d.weight, slots, out=conv_out[span]
                )
                continue
            window = torch.cat([conv_states[slots].to(mixed.dtype), mixed[span, :, None]], -1)  # [B, C, K]
            conv_states[slots] = window[:, :, 1:].float()
            conv_out[span] = self._conv(window)[:, :, -1]
        for i, chunk in enumerate(meta.prefills if rows > nd else ()):
            slot = meta.seq_slots[nd + i : nd + i + 1]  # [1], a tensor: no device sync
            span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            seq = torch.cat([conv_states[slot].to(mixed.dtype), mixed[span].T[None]], dim=-1)  # [1, C, K-1+L]
            conv_states[slot] = seq[:, :, seq.shape[-1] - (self.kernel - 1) :].float()
            conv_out[span] = self._conv(seq)[0].T
        return conv_out

    def _rule_rows(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        a: torch.Tensor,
        b: torch.Tensor,
        rec_states: torch.Tensor,
        meta: AttentionMetadata,
        kernels: ModuleType | None,
        core: torch.Tensor,
    ) -> None:
        """core[:rows] := the gated delta rule over q, k, v [rows, ...] (the decode rows by the
        recurrent form, then the prefill chunks by the chunked one), from and back into the states."""
        nd = meta.num_decode_tokens
        raw = None  # decode rows alone, by the kernel: it makes the gates from a, b itself
        if kernels is not None and self.fused and q.shape[0] == nd:
            g, beta, raw = a, b, (self.A_log, self.dt_bias)
        elif self.fused:
            from splitserve.kernels.fused import gdn_gates

            g, beta = gdn_gates(a, b, self.A_log, self.dt_bias)
        else:
            beta = b.sigmoid()  # [rows, Hv]
            g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)  # [rows, Hv] log-decay, fp32
        for d in meta.decode_spans() if nd else ():  # one token of each sequence at a time
            slots = meta.seq_slots[d]
            if kernels is not None:
                kernels.fused_recurrent_gated_delta_rule_update(
                    q[d], k[d], v[d], g[d], beta[d], rec_states, slots, out=core[d], raw_gates=raw
                )
                continue
            out, state = recurrent_gated_delta_rule(  # batch of B sequences, one token each
                q[d, None], k[d, None], v[d, None], g[d, None], beta[d, None], rec_states[slots]
            )
            core[d] = out[:, 0]
            rec_states[slots] = state
        for i, chunk in enumerate(meta.prefills if q.shape[0] > nd else ()):
            slot = meta.seq_slots[nd + i : nd + i + 1]
            span = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out, state = chunk_gated_delta_rule(
                q[None, span], k[None, span], v[None, span], g[None, span], beta[None, span], rec_states[slot]
            )
            core[span] = out[0]
            rec_states[slot] = state

    def _conv(self, seq: torch.Tensor) -> torch.Tensor:
        # seq [B, C, K - 1 + L] (left context included) -> silu(conv) [B, C, L], in seq's dtype
        w = self.conv1d.weight  # [C, 1, K]
        return F.silu(F.conv1d(seq.to(w.dtype), w, groups=self.conv_dim)).to(seq.dtype)
