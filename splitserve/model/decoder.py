"""Dense decoder-only transformers: Llama (SmolLM2, Llama 3.x), Qwen2 (QKV bias), Qwen3 (QK-norm).

The three differ only in flags read from `ModelConfig`, so one implementation serves them. The model
runs on a flat batch of tokens (no padding) and reads/writes the paged KV cache through an
`AttentionBackend`; it returns hidden states, and `compute_logits` runs the LM head only on the rows
that will be sampled.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from splitserve.kernels.cpu import fused as cpu_fused
from splitserve.kernels.cpu import gemm as cpu_gemm
from splitserve.kernels.cpu import layer as cpu_layer
from splitserve.kernels.cpu import linear as cpu_linear
from splitserve.kernels.cpu import threads as cpu_threads
from splitserve.model.attention import AttentionBackend, AttentionMetadata, TorchPagedAttention
from splitserve.model.config import ModelConfig
from splitserve.model.layers import GatedMLP, Linear, RMSNorm, RotaryEmbedding, linear
from splitserve.model.parallel import gather_logits
from splitserve.model.weights import load_mapped_weights


@dataclass(frozen=True)
class ForwardContext:
    attn: AttentionBackend
    meta: AttentionMetadata
    kv_cache: torch.Tensor  # [num_blocks, L_kv, 2, block_size, KVH, D]
    states: dict[str, torch.Tensor] = field(default_factory=dict)  # hybrid: [num_slots, *state_shape]
    linear_prefill: Any = None  # hybrid, varlen backend: the step's gdn_prefill.LinearPrefill


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.layer = layer
        self.h, self.kvh, self.d = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        qkv_out = (self.h + 2 * self.kvh) * self.d
        self.qkv_proj = Linear(cfg.hidden_size, qkv_out, bias=cfg.attention_bias)
        self.o_proj = Linear(self.h * self.d, cfg.hidden_size, bias=False)
        self.q_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(self.d, cfg.rms_norm_eps) if cfg.qk_norm else None

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        t = x.shape[0]
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * D]
        q, k, v = qkv.split([self.h * self.d, self.kvh * self.d, self.kvh * self.d], dim=-1)
        q, k, v = q.view(t, self.h, self.d), k.view(t, self.kvh, self.d), v.view(t, self.kvh, self.d)
        if self.q_norm is not None and self.k_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(positions, q, k)
        out = ctx.attn.forward(self.layer, q, k, v.contiguous(), ctx.kv_cache, ctx.meta)  # [T, H * D]
        return self.o_proj(out)

    def forward_cpu(
        self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        """CPU fp32: q/k norm, rotary and the KV store in one op (kernels/cpu/fused.py), then attention."""
        t, kv = x.shape[0], ctx.kv_cache
        qkv = self.qkv_proj(x)  # [T, (H + 2 KVH) * D]
        norms = None
        if self.q_norm is not None and self.k_norm is not None:
            norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps)
        q, k = cpu_fused.rope_store(
            qkv, positions, rope.cos, rope.sin, kv[:, self.layer, 0], kv[:, self.layer, 1],
            ctx.meta.slot_mapping, (self.h, self.kvh), norms,
        )  # fmt: skip
        v = qkv[:, (self.h + self.kvh) * self.d :].view(t, self.kvh, self.d)
        attn = ctx.attn
        assert isinstance(attn, TorchPagedAttention)  # DecoderLM._cpu_fused_applies
        return self.o_proj(attn.forward(self.layer, q, k, v, kv, ctx.meta, stored=True))

    def forward_fused(
        self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        """CUDA: q/k norm, rotary and the KV store in one kernel, then the backend's attention."""
        from splitserve.kernels.fused import qk_norm_rope_store

        kv = ctx.kv_cache
        q = qk_norm_rope_store(
            self.qkv_proj(x), self.h, self.kvh, positions, rope.cos, rope.sin,
            kv[:, self.layer, 0], kv[:, self.layer, 1], ctx.meta.slot_mapping,
            self.q_norm.weight if self.q_norm is not None else None,
            self.k_norm.weight if self.k_norm is not None else None,
            self.q_norm.eps if self.q_norm is not None else 0.0,
        )  # fmt: skip
        return OutProj(ctx.attn.attend(self.layer, q, kv, ctx.meta), self.o_proj)  # type: ignore[attr-defined]


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size)

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor, rope: RotaryEmbedding, ctx: ForwardContext
    ) -> torch.Tensor:
        a = self.self_attn(positions, self.input_layernorm(x), rope, ctx)
        if x.device.type == "cpu" and not torch.is_grad_enabled():  # in place: no fresh [T, hidden] pages
            x.add_(a)
            return x.add_(self.mlp(self.post_attention_layernorm(x)))
        x = x + a
        return x + self.mlp(self.post_attention_layernorm(x))


class DecoderLM(nn.Module):
    """Llama / Qwen2 / Qwen3 causal LM over a flat token batch."""

    def __init__(self, cfg: ModelConfig, max_positions: int) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, False)
        self.rope = RotaryEmbedding(cfg.rope, cfg.head_dim, max_positions)
        self.fused = False
        self.cpu_fused = False  # set by enable_cpu_fused (CPU engines)
        self.cpu_layer = False  # the same: decode-only steps through kernels/cpu/layer.py's op once loaded
        self.cpu_lm_head: Callable[[torch.Tensor], torch.Tensor] | None = None  # CPU: see cpu_linear
        self._layer_args: list[tuple] | None = None  # `_cpu_layer_args`'s cache, and its key
        self._layer_args_key: tuple[object, torch.Tensor, bool] | None = None

    def enable_fused_kernels(self) -> bool:
        """Use the Triton kernels of splitserve.kernels.fused (CUDA, with a backend that has
        `attend`); they reproduce the plain path's roundings. -> whether they are on."""
        d = self.cfg.head_dim
        self.fused = d >= 32 and d & (d - 1) == 0
        return self.fused

    def enable_cpu_fused(self) -> bool:
        """Use kernels/cpu/fused.py's ops for each layer's norms, residual adds, rotary and KV store on
        CPU fp32 (built in the background: the plain path runs until they are ready). -> whether on."""
        self.cpu_fused = cpu_fused.start() and self.rope.cos.shape[-1] == self.cfg.head_dim
        self.cpu_layer = self.cpu_fused and cpu_layer.start()
        return self.cpu_fused

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        if self.fused:
            return self._forward_fused(input_ids, positions, ctx)
        if self.cpu_fused and self._cpu_fused_applies(ctx):
            return self._forward_cpu_fused(input_ids, positions, ctx)
        x = self.embed_tokens(input_ids)  # [T, hidden]
        for layer in self.layers:
            cpu_threads.checkpoint()
            x = layer(positions, x, self.rope, ctx)
        return self.norm(x)

    def _cpu_fused_applies(self, ctx: ForwardContext) -> bool:
        """The ops are loaded, weights, cache and tables are fp32, the torch backend, no autograd."""
        fp32 = self.embed_tokens.weight.dtype == ctx.kv_cache.dtype == self.rope.cos.dtype == torch.float32
        torch_backend = isinstance(ctx.attn, TorchPagedAttention)
        return fp32 and torch_backend and cpu_fused.ready() and not torch.is_grad_enabled()

    def _forward_cpu_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """`forward` with each residual add fused into the RMSNorm after it, the MLP's SiLU-and-multiply
        in one op, and each attention's q/k norm, rotary and KV store in one (`Attention.forward_cpu`)."""
        layers = self.layers
        residual = self.embed_tokens(input_ids)  # [T, hidden], fresh: updated in place by each add
        norm = layers[0].input_layernorm
        h = cpu_fused.add_rms_norm(residual, None, norm.weight, norm.eps)
        group = ctx.meta.sole_decode_group(len(input_ids))
        args = self._cpu_layer_args(ctx, len(input_ids)) if group is not None else None
        if group is not None and args is not None:  # decode only: a C++ call a layer (kernels/cpu/layer.py)
            kv, scale = ctx.kv_cache, ctx.attn.scale  # type: ignore[attr-defined]
            dyn = (positions, ctx.meta.slot_mapping, group.block_tables, group.context_lens)
            dyn += (self.rope.cos, self.rope.sin)
            for i, layer_args in enumerate(args):
                cpu_threads.checkpoint()
                h = cpu_layer.decode_layer(h, residual, dyn, kv[:, i, 0], kv[:, i, 1], layer_args, scale)
            return h
        for i, layer in enumerate(layers):
            cpu_threads.checkpoint()
            a = layer.self_attn.forward_cpu(positions, h, self.rope, ctx)
            post = layer.post_attention_layernorm
            h = cpu_fused.add_rms_norm(a, residual, post.weight, post.eps)
            nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else self.norm
            mlp = layer.mlp
            cpu_threads.checkpoint()  # a prompt layer's MLP products are most of its time
            g = cpu_fused.silu_mul(mlp.gate_up_proj(h))
            cpu_threads.checkpoint()
            m = mlp.down_proj(g)
            h = cpu_fused.add_rms_norm(m, residual, nxt.weight, nxt.eps)
        return h

    def _cpu_layer_args(self, ctx: ForwardContext, rows: int) -> list[tuple] | None:
        """Each layer's constant arguments for `cpu_layer.decode_layer` where a decode-only step of
        `rows` can take it: the rows fit the panels, attention reads the blocks in place, the op is
        loaded; else None. Kept between steps while the first layer's QKV matmul and norm weight are
        the same objects (cpu_linear's prepare_model and drop_dense replace them all at once) and the
        panels' op is as loaded as it was."""
        if not self.cpu_layer or rows > cpu_gemm.MAX_ROWS or not cpu_layer.ready():
            return None
        qkv = self.layers[0].self_attn.qkv_proj.cpu_matmul
        if isinstance(qkv, cpu_linear.OneDNNMatmul) and qkv.takes_amx(rows):  # kernels/cpu/amx.py's products
            return None
        int4 = isinstance(self.layers[0].self_attn.qkv_proj.cpu_matmul, cpu_linear.Int4Matmul)
        if int4 and rows >= cpu_linear.INT4_BF16_ROWS:  # the int4 option's bf16 products (cpu_linear)
            return None
        attn = ctx.attn
        if not (isinstance(attn, TorchPagedAttention) and attn.reads_in_place(ctx.kv_cache)):
            return None
        first = self.layers[0]
        key = (first.self_attn.qkv_proj.cpu_matmul, first.post_attention_layernorm.weight, cpu_gemm.ready())
        held = self._layer_args_key  # the objects themselves (an id could be reused once one is freed)
        if held is None or any(a is not b for a, b in zip(held, key, strict=True)):
            nxt = [layer.input_layernorm for layer in self.layers[1:]] + [self.norm]
            args = [cpu_layer.layer_args(layer, n) for layer, n in zip(self.layers, nxt, strict=True)]
            self._layer_args = None if any(a is None for a in args) else args
            self._layer_args_key = key
        return self._layer_args

    def _forward_fused(
        self, input_ids: torch.Tensor, positions: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        def mix(layer: nn.Module, h: torch.Tensor) -> OutProj:
            return layer.self_attn.forward_fused(positions, h, self.rope, ctx)

        return fused_forward(self, input_ids, mix, zero_centred=False, lazy_norm=True)

    def build_rope(self, max_positions: int, device: torch.device) -> None:
        """(Re)compute the cos/sin tables on `device` after weights were materialized from `meta`."""
        self.rope = RotaryEmbedding(self.cfg.rope, self.cfg.head_dim, max_positions).to(device)

    def state_shapes(self) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """Per-sequence recurrent state (none for pure-attention models)."""
        return {}

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return head_logits(self, hidden)

    def load_weights(self, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy HF-named tensors into this model's (merged) parameters; every parameter must be set."""
        load_mapped_weights(
            self, tensors, self.map_weight_name, self.expected_weight_keys(), self.cfg.architecture
        )

    def map_weight_name(self, name: str) -> tuple[str | None, tuple[int, int] | None]:
        """HF tensor name -> (our parameter, its row range in a merged weight or None); None: skip."""
        return _map_name(name, self.cfg)

    def expected_weight_keys(self) -> list[str]:
        """The `param:rows` keys that a checkpoint must fill (see `load_mapped_weights`)."""
        return _expected_keys(self)


@dataclass(frozen=True)
class OutProj:
    """A token mixer's output before its output projection: `fused_forward` applies `proj`, at batch
    1 with the residual add in the GEMV's epilogue."""

    x: torch.Tensor  # [T, in_features]
    proj: Linear


def head_logits(model: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """A model's logits [N, vocab] in fp32: through its CPU head (`cpu_lm_head`, set by
    cpu_linear.prepare_model: results that do not depend on the thread count) where it has one, else
    the LM head's weight (or the tied embedding's)."""
    if model.cpu_lm_head is not None:
        return gather_logits(model, model.cpu_lm_head(hidden).float())
    weight = model.embed_tokens.weight if model.lm_head is None else model.lm_head.weight
    return gather_logits(model, linear(hidden, weight).float())  # tensor parallel: each rank's vocab rows


def fused_forward(
    model: nn.Module,
    input_ids: torch.Tensor,
    mix: Callable[[nn.Module, torch.Tensor], torch.Tensor | OutProj],
    zero_centred: bool,
    lazy_norm: bool = False,
) -> torch.Tensor:
    """A pre-norm decoder's forward with the fused Triton kernels (splitserve.kernels.fused): each
    residual add is fused into the next RMSNorm, the MLP's activation into one SiLU-and-multiply.
    `mix(layer, h)`: the layer's token mixer (attention, or Qwen3.5's DeltaNet) on its normed input.
    The model has `embed_tokens`, `layers` (with `input_layernorm`, `post_attention_layernorm`, `mlp`)
    and `norm`; `zero_centred`: its norms store 1 + w (Qwen3.5).

    One token (batch-1 decode, GEMV on) fuses further, into kernels/gemv.py's GEMVs: the residual
    adds into the GEMVs that produce them (down_proj, and the mixer's output projection when it
    returns an `OutProj`), SiLU-and-multiply into down_proj, and each RMSNorm into the GEMV that reads
    it (gate/up, and the mixer's projections when `lazy_norm`: its input may be a `NormedRow`). Three
    kernels fewer per layer."""
    from splitserve.kernels import gemv
    from splitserve.kernels.fused import rmsnorm, silu_mul

    eps = model.cfg.rms_norm_eps
    layers = model.layers
    residual = model.embed_tokens(input_ids)  # [T, hidden], updated in place by each add
    # NOTE: not fp16: the factored norm stores w * residual unnormalized, which fp16's range may not hold
    row = residual.dtype != torch.float16 and gemv.ENABLED and gemv.FUSE
    row = row and gemv.use_gemv(residual, layers[0].mlp.down_proj.weight)
    row = row and getattr(model, "tp", None) is None  # the GEMV epilogue adds before a rank's all-reduce

    h = rmsnorm(residual, layers[0].input_layernorm.weight, eps, zero_centred=zero_centred)
    for i, layer in enumerate(layers):
        a = mix(layer, h)
        post = layer.post_attention_layernorm.weight
        if row and isinstance(a, OutProj):
            h = gemv.gemv_into_residual(a.x, a.proj.weight, a.proj.bias, residual, post, eps, zero_centred)
        else:
            a = a.proj(a.x) if isinstance(a, OutProj) else a
            h = rmsnorm(a, post, eps, residual, zero_centred)
        nxt = layers[i + 1].input_layernorm if i + 1 < len(layers) else model.norm
        mlp = layer.mlp
        if row:
            down, gate_up = mlp.down_proj, mlp.gate_up_proj(h)
            h = gemv.gemv_into_residual(
                gate_up, down.weight, down.bias, residual, nxt.weight, eps, zero_centred, True
            )
            h = h if lazy_norm and i + 1 < len(layers) else h.materialize()
        else:
            h = rmsnorm(mlp.down_proj(silu_mul(mlp.gate_up_proj(h))), nxt.weight, eps, residual, zero_centred)
    return h


_QKV = {"q_proj": 0, "k_proj": 1, "v_proj": 2}
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def _map_name(name: str, cfg: ModelConfig) -> tuple[str | None, tuple[int, int] | None]:
    """HF parameter name -> (our parameter name, row range inside a merged weight or None)."""
    if name.startswith("model."):
        name = name[len("model.") :]
    if "rotary_emb" in name:
        return None, None
    parts = name.split(".")
    if len(parts) >= 4 and parts[0] == "layers" and parts[3] in _QKV:
        q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        starts = (0, q, q + kv)
        sizes = (q, kv, kv)
        i = _QKV[parts[3]]
        return ".".join([*parts[:3], "qkv_proj", *parts[4:]]), (starts[i], starts[i] + sizes[i])
    if len(parts) >= 4 and parts[0] == "layers" and parts[3] in _GATE_UP:
        i = _GATE_UP[parts[3]]
        n = cfg.intermediate_size
        return ".".join([*parts[:3], "gate_up_proj", *parts[4:]]), (i * n, (i + 1) * n)
    return name, None


def _expected_keys(model: DecoderLM) -> list[str]:
    keys = []
    for name, param in model.named_parameters():
        if ".qkv_proj." in name:
            q, kv = model.cfg.num_heads * model.cfg.head_dim, model.cfg.num_kv_heads * model.cfg.head_dim
            keys += [f"{name}:{r}" for r in ((0, q), (q, q + kv), (q + kv, q + 2 * kv))]
        elif ".gate_up_proj." in name:
            n = param.shape[0] // 2
            keys += [f"{name}:{r}" for r in ((0, n), (n, 2 * n))]
        else:
            keys.append(f"{name}:None")
    return keys
