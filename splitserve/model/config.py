"""The engine's view of a checkpoint's architecture: one frozen dataclass read from an HF config dict.

Both loaders (HF directory and GGUF) produce a config.json-style dict; `ModelConfig.from_hf` turns it
into the handful of numbers the model code and the KV cache need. Older configs carry `rope_theta` and
`rope_scaling`; transformers 5 writes `rope_parameters`: both are read.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class RopeConfig:
    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192


@dataclass(frozen=True)
class LinearAttentionConfig:
    """Gated DeltaNet layers of hybrid models (Qwen3.5)."""

    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int

    @property
    def conv_dim(self) -> int:
        return 2 * self.num_key_heads * self.key_head_dim + self.num_value_heads * self.value_head_dim


@dataclass(frozen=True)
class ModelConfig:
    architecture: str  # registry key, e.g. "LlamaForCausalLM"
    model_type: str  # llama | qwen2 | qwen3
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool
    qk_norm: bool
    rope: RopeConfig = field(default_factory=RopeConfig)
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    layer_types: tuple[str, ...] = ()  # hybrid models: "full_attention" | "linear_attention" per layer
    partial_rotary_factor: float = 1.0
    linear: LinearAttentionConfig | None = None
    num_mtp_layers: int = 0  # Qwen3.5: layers of the multi-token-prediction head (`mtp.*`) the checkpoint has

    @property
    def kv_layer_ids(self) -> tuple[int, ...]:
        """Layers that keep paged KV (all of them, except a hybrid model's linear-attention layers)."""
        if not self.layer_types:
            return tuple(range(self.num_layers))
        return tuple(i for i, t in enumerate(self.layer_types) if t == "full_attention")

    @property
    def num_kv_layers(self) -> int:
        return len(self.kv_layer_ids)

    @property
    def is_hybrid(self) -> bool:
        return self.linear is not None

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
        if "text_config" in cfg:  # multimodal wrapper (Qwen3.5): the language model's config
            cfg = _text_config_of(cfg)
        model_type = cfg.get("model_type", "llama")
        archs = cfg.get("architectures") or []
        hidden = int(cfg["hidden_size"])
        heads = int(cfg["num_attention_heads"])
        eos = cfg.get("eos_token_id")
        eos_ids = tuple(eos) if isinstance(eos, list) else ((eos,) if eos is not None else ())
        return cls(
            architecture=archs[0] if archs else model_type,
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
            head_dim=int(cfg.get("head_dim") or hidden // heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            attention_bias=bool(cfg.get("attention_bias", model_type == "qwen2")),
            qk_norm=model_type in ("qwen3", "qwen3_5_text", "qwen3_5"),
            rope=_rope_from_hf(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
            **_hybrid_from_hf(cfg),
        )


def _text_config_of(outer: dict[str, Any]) -> dict[str, Any]:
    """The nested `text_config` of a multimodal wrapper, with what HF reads from the outer config:
    `tie_word_embeddings` (the wrapper model ties by its own config's flag) and, where the text
    config lacks them, the special token ids."""
    cfg = {**outer["text_config"], "architectures": outer.get("architectures")}
    if "tie_word_embeddings" in outer:
        cfg["tie_word_embeddings"] = outer["tie_word_embeddings"]
    for key in ("bos_token_id", "eos_token_id"):
        if cfg.get(key) is None and outer.get(key) is not None:
            cfg[key] = outer[key]
    return cfg


def _hybrid_from_hf(cfg: dict[str, Any]) -> dict[str, Any]:
    if "linear_num_value_heads" not in cfg:
        return {}
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or [
        "full_attention" if (i + 1) % int(cfg.get("full_attention_interval", 4)) == 0 else "linear_attention"
        for i in range(layers)
    ]
    rope = {**(cfg.get("rope_scaling") or {}), **(cfg.get("rope_parameters") or {})}
    return {
        "num_mtp_layers": int(cfg.get("mtp_num_hidden_layers") or 0),
        "layer_types": tuple(types),
        "partial_rotary_factor": float(
            rope.get("partial_rotary_factor", cfg.get("partial_rotary_factor", 0.25))
        ),
        "linear": LinearAttentionConfig(
            num_key_heads=int(cfg["linear_num_key_heads"]),
            num_value_heads=int(cfg["linear_num_value_heads"]),
            key_head_dim=int(cfg["linear_key_head_dim"]),
            value_head_dim=int(cfg["linear_value_head_dim"]),
            conv_kernel=int(cfg.get("linear_conv_kernel_dim", 4)),
        ),
    }


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
    if kind == "mrope":  # Qwen3.5: for text-only input every section has the same position
        kind = "default"
    if kind not in ("default", "linear", "llama3"):
        raise ValueError(f"unsupported rope_type {kind!r}; supported: default, linear, llama3")
    return RopeConfig(
        theta=theta,
        kind=kind,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position=int(params.get("original_max_position_embeddings", 8192)),
    )
