"""Qwen3.5 hybrid text model: Gated DeltaNet (linear attention) layers interleaved with gated full attention.

Layer types (`cfg.layer_types`; by default every `full_attention_interval`-th layer is full attention):

- "linear_attention": a Gated DeltaNet. One projection gives q/k/v (through a depthwise causal conv
  of width `conv_kernel` and SiLU), the output gate z, beta (sigmoid) and the log-decay g
  (`-exp(A_log) * softplus(a + dt_bias)`); the gated delta rule (`gated_delta.py`) mixes tokens
  through a fixed-size per-sequence state; a gated RMSNorm (`norm(o) * silu(z)`) precedes out_proj.
- "full_attention": softmax attention over the paged KV cache, with q/k RMSNorm, RoPE on the first
  `head_dim * partial_rotary_factor` dims only, and an output gate: q_proj yields per head
  [query | gate], and the attention output is multiplied by sigmoid(gate) before o_proj.

Every RMSNorm except the gated one is zero-centred (`norm(x) * (1 + w)`, fp32). The MLP is the usual
SwiGLU. Text-only input puts the same position in every M-RoPE section, so M-RoPE is plain RoPE here.

State layout. Only the full-attention layers have KV: the cache holds `cfg.num_kv_layers` layers and a
full-attention layer addresses it by its index in `cfg.kv_layer_ids`. The linear layers keep, per
sequence, a state slot in the engine's `StatePool` (`state_shapes()`), all fp32:

    states["conv"]       [num_slots, num_linear_layers, conv_dim, conv_kernel - 1]  last conv inputs
    states["recurrent"]  [num_slots, num_linear_layers, value_heads, key_head_dim, value_head_dim]

The Gated DeltaNet layer itself is in gdn_layer.py. `AttentionMetadata.seq_slots` gives each sequence's
slot (decodes first, then prefill chunks, as in the flat batch). Decode tokens are advanced together
with the recurrent form (on CUDA by the fused Triton kernels of splitserve/kernels/gated_delta.py, in
place on the state pools); each prefill chunk runs the causal conv from its slot's conv window and the
chunked rule from its slot's recurrent state, and both are written back, so a prompt may be split into
chunks at any position. On CUDA with fla-core all prefill chunks of a step go through one varlen conv
launch and one varlen gated delta rule per layer (gdn_prefill.py, `linear_attention_backend`); the
per-chunk torch rule is the CPU path and the reference. A slot is zeroed when allocated, which is the
state before a sequence's first token; a prefix-cache hit copies a state checkpoint into it
(engine/state_cache.py).

The multi-token-prediction head (`mtp.*`) is a module of its own (qwen3_5_mtp.py), loaded when
speculative decoding asks for it. Out of scope: the vision tower (`model.visual.*`) of
`Qwen3_5ForConditionalGeneration` checkpoints (only the language model is loaded, its
`model.language_model.*` names read as `model.*`); GGUF files for qwen35.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import TYPE_CHECKING

import torch
from torch import nn

from splitserve.kernels.cpu import threads as cpu_threads
from splitserve.model.config import ModelConfig
from splitserve.model.decoder import ForwardContext, OutProj, fused_forward, head_logits
from splitserve.model.errors import ModelLoadError
from splitserve.model.gdn_layer import GatedDeltaNet
from splitserve.model.gdn_prefill import build_linear_prefill
from splitserve.model.layers import GatedMLP, Linear, PartialRotaryEmbedding, ZeroCentredRMSNorm
from splitserve.model.qwen3_5_weights import expected_keys, hf_named, map_name, merged_rows
from splitserve.model.weights import load_mapped_weights

if TYPE_CHECKING:
    from splitserve.kernels.gemv import NormedRow


def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


class GatedAttention(nn.Module):
    """Full attention with q/k norm, partial RoPE and a sigmoid output gate."""

    def __init__(self, cfg: ModelConfig, kv_index: int) -> None:
        super().__init__()
        self.kv_index = kv_index  # this layer's index in the KV cache (position in cfg.kv_layer_ids)
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        # rows: per head [query | gate] (2 * H * D), then k (KVH * D), then v (KVH * D)
        self.qkv_proj = Linear(cfg.hidden_size, 2 * (self.h + self.kvh) * self.d, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=cfg.attention_bias)
        self.q_norm = ZeroCentredRMSNorm(self.d, cfg.rms_norm_eps)
        self.k_norm = ZeroCentredRMSNorm(self.d, cfg.rms_norm_eps)
        self.fused = False  # set by Qwen3_5LM.enable_fused_kernels (CUDA, a backend with `attend`)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rope: PartialRotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        return self.o_proj(self.mix(positions, x, rope, ctx))

    def mix(
        self,
        positions: torch.Tensor,
        x: torch.Tensor | NormedRow,
        rope: PartialRotaryEmbedding,
        ctx: ForwardContext,
    ) -> torch.Tensor:
        """The gated attention output [T, H * D], o_proj's input. `x` may be a `NormedRow` (the fused
        batch-1 path: the QKV GEMV normalizes it as it reads it)."""
        t = x.shape[0]
        if self.fused:  # q/k norm, partial rotary and the KV store in one kernel; the gate in one more
            from splitserve.kernels.fused import gated_qk_norm_rope_store, sigmoid_gate_mul

            qkv = self.qkv_proj(x)
            cos, sin = rope.tables(qkv.device)
            q = gated_qk_norm_rope_store(
                qkv, self.h, self.kvh, rope.rotary_dim, positions, cos, sin,
                ctx.kv_cache[:, self.kv_index, 0], ctx.kv_cache[:, self.kv_index, 1], ctx.meta.slot_mapping,
                self.q_norm.weight, self.k_norm.weight, self.q_norm.eps,
            )  # fmt: skip
            out = ctx.attn.attend(self.kv_index, q, ctx.kv_cache, ctx.meta)  # type: ignore[attr-defined]
            return sigmoid_gate_mul(out.view(t, self.h * self.d), qkv, self.h, self.d)
        qg, k, v = self.qkv_proj(x).split([2 * self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q, gate = qg.view(t, self.h, 2 * self.d).chunk(2, dim=-1)  # [T, H, D] each
        q = self.q_norm(q)
        k = self.k_norm(k.view(t, self.kvh, self.d))
        q, k = rope(positions, q, k)
        out = ctx.attn.forward(self.kv_index, q, k, v.reshape(t, self.kvh, self.d), ctx.kv_cache, ctx.meta)
        return out * torch.sigmoid(gate.reshape(t, self.h * self.d))  # out: [T, H * D]


class HybridLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.is_linear = cfg.layer_types[layer] == "linear_attention"
        self.input_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if self.is_linear:
            self.linear_attn = GatedDeltaNet(cfg, cfg.layer_types[:layer].count("linear_attention"))
        else:
            self.self_attn = GatedAttention(cfg, cfg.kv_layer_ids.index(layer))
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rope: PartialRotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.is_linear:
            h = self.linear_attn(h, ctx)
        else:
            h = self.self_attn(positions, h, rope, ctx)
        x = x + h
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen3_5LM(nn.Module):
    """Qwen3.5 (hybrid Gated DeltaNet / gated attention) causal LM over a flat token batch."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        if cfg.linear is None or len(cfg.layer_types) != cfg.num_layers:
            raise ModelLoadError(
                f"{cfg.architecture}: config lacks the linear-attention settings or layer_types"
            )
        unknown = set(cfg.layer_types) - {"linear_attention", "full_attention"}
        if unknown:
            raise ModelLoadError(f"{cfg.architecture}: unsupported layer types {sorted(unknown)}")
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(HybridLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = ZeroCentredRMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
        # CPU: the head through cpu_linear's matmul, as the decoder's; F.linear (MKL) on an AMD host gave
        # logits that depend on the thread count (tests/core/test_core_share.py), which lending changes
        self.cpu_lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None
        rotary_dim = int(cfg.head_dim * cfg.partial_rotary_factor)
        # NOTE: its tables are built on the CPU even under `meta` and copied per device on first use
        self.partial_rope = PartialRotaryEmbedding(cfg.rope, rotary_dim, max_positions)
        self.fused = False
        self.varlen = False

    def build_rope(self, max_positions: int, device: torch.device) -> None:
        """Nothing to do: PartialRotaryEmbedding keeps CPU tables and copies them per device."""

    @property
    def num_linear_layers(self) -> int:
        return self.cfg.layer_types.count("linear_attention")

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.varlen and ctx.linear_prefill is None:  # the step's prefill metadata, once for all layers
            ctx = replace(ctx, linear_prefill=build_linear_prefill(ctx.meta, input_ids.device))
        if self.fused:
            return self._forward_fused(input_ids, positions, ctx)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            cpu_threads.checkpoint()
            x = layer(positions, x, self.partial_rope, ctx)
        return self.norm(x)

    def set_linear_attention_backend(self, backend: str) -> None:
        """Backend "torch": each prefill chunk by the torch rule; "fla": all of a step's chunks in one varlen
        launch per layer (gdn_prefill.py). Decode rows take the same path either way."""
        self.varlen = backend == "fla"
        for layer in self.layers:
            if layer.is_linear:
                layer.linear_attn.varlen = self.varlen

    def enable_fused_kernels(self) -> bool:
        """CUDA: the zero-centred RMSNorms with their residual adds, and SiLU-and-multiply, as Triton
        kernels (splitserve.kernels.fused) that reproduce the plain path's roundings."""
        self.fused = True
        for layer in self.layers:
            if layer.is_linear and layer.linear_attn.dv & (layer.linear_attn.dv - 1) == 0:
                layer.linear_attn.fused = True
            elif not layer.is_linear:
                attn = layer.self_attn
                rot = self.partial_rope.rotary_dim
                attn.fused = _pow2(attn.d) and _pow2(rot) and rot >= 2
        return True

    def _forward_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        def mix(layer: nn.Module, h: torch.Tensor | NormedRow) -> OutProj:
            if layer.is_linear:
                return OutProj(layer.linear_attn.mix(h, ctx), layer.linear_attn.out_proj)
            return OutProj(layer.self_attn.mix(positions, h, self.partial_rope, ctx), layer.self_attn.o_proj)

        return fused_forward(self, input_ids, mix, zero_centred=True, lazy_norm=True)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        lin = self.cfg.linear
        assert lin is not None
        n = self.num_linear_layers
        return {
            "conv": ((n, lin.conv_dim, lin.conv_kernel - 1), torch.float32),
            "recurrent": ((n, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim), torch.float32),
        }

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self, hidden)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into this model's (merged) parameters; every parameter must be set.

        Accepts `Qwen3_5ForCausalLM` names and `Qwen3_5ForConditionalGeneration` ones
        (`model.language_model.*`); vision-tower and MTP tensors are skipped (the MTP head loads its own:
        qwen3_5_mtp.py).
        """
        load_mapped_weights(
            self, tensors, self.map_weight_name, self.expected_weight_keys(), self.cfg.architecture
        )

    def map_weight_name(self, name: str) -> tuple[str | None, tuple[int, int] | None]:
        """HF tensor name -> (our parameter, its row range in a merged weight or None); None: skip."""
        return map_name(name, merged_rows(self.cfg))

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        """Our parameters under `Qwen3_5ForCausalLM` names, merged weights split by rows (views)."""
        return hf_named(self, merged_rows(self.cfg))

    def expected_weight_keys(self) -> list[str]:
        """The `param:rows` keys that a checkpoint must fill (see `load_mapped_weights`)."""
        return expected_keys(self, merged_rows(self.cfg))
