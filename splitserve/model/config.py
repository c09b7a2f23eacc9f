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

    @classmethod
    def from_hf(cls, cfg: dict[str, Any]) -> ModelConfig:
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
            qk_norm=model_type == "qwen3",
            rope=_rope_from_hf(cfg),
            bos_token_id=cfg.get("bos_token_id"),
            eos_token_ids=eos_ids,
        )


def _rope_from_hf(cfg: dict[str, Any]) -> RopeConfig:
    params = dict(cfg.get("rope_parameters") or {})
    scaling = cfg.get("rope_scaling") or {}
    params = {**scaling, **params}
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or params.get("type") or "default"
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
