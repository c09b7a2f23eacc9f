"""Tiny random-weight model configs shared by the engine and PD tests (importable: tests/ is on
sys.path through its conftest)."""

from __future__ import annotations

from pathlib import Path

TINY_QWEN3_5 = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,  # full_attention_interval 4: layers 3 and 7 are full attention
    "full_attention_interval": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "max_position_embeddings": 512,
    "initializer_range": 0.1,  # larger logits than 0.02: no fp32 near-ties among the top tokens
    "tie_word_embeddings": False,
}


def save_tiny_qwen3_5(path: Path, seed: int = 1) -> Path:
    """A tiny Qwen3.5 (TINY_QWEN3_5) with random weights drawn from `seed`, saved as an HF checkpoint."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(seed)
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY_QWEN3_5)).eval().save_pretrained(path)
    return path
