"""Fixtures for the engine tests: tiny random-weight HF checkpoints (Qwen2, Qwen3, Llama 3 rope) saved
as safetensors directories without a tokenizer, each with HF transformers' greedy continuations."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

TINY_VOCAB = 1000
TINY_MAX_NEW = 24
TINY_PROMPT_LENS = (5, 17, 33, 64, 100, 9)  # 100 + 24 tokens = 8 blocks of 16

_COMMON = dict(
    vocab_size=TINY_VOCAB,
    hidden_size=96,
    intermediate_size=192,
    num_hidden_layers=3,
    num_attention_heads=6,
    num_key_value_heads=2,  # GQA: 3 query heads per KV head
    max_position_embeddings=256,
    initializer_range=0.15,  # large enough that greedy logits are far from ties
    tie_word_embeddings=False,
    rms_norm_eps=1e-6,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)


def _tiny_config(arch: str):
    from transformers import LlamaConfig, Qwen2Config, Qwen3Config

    if arch == "qwen2":  # Qwen2 always has q/k/v biases
        return Qwen2Config(**_COMMON, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    if arch == "qwen3":  # QK-norm, and head_dim 32 != hidden 96 / 6 heads
        return Qwen3Config(
            **_COMMON, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0}
        )
    if arch == "llama3":  # llama3 rope scaling, with thresholds inside the tested context lengths
        rope = {
            "rope_type": "llama3",
            "rope_theta": 10000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 32,
        }
        return LlamaConfig(**_COMMON, rope_parameters=rope)
    raise ValueError(arch)


def _model_class(arch: str):
    from transformers import LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM

    return {"qwen2": Qwen2ForCausalLM, "qwen3": Qwen3ForCausalLM, "llama3": LlamaForCausalLM}[arch]


@dataclass(frozen=True)
class TinyModel:
    arch: str
    path: Path
    prompts: list[list[int]]
    hf_greedy: list[list[int]]  # HF generate(do_sample=False), `max_new` tokens, no EOS stopping
    max_new: int = TINY_MAX_NEW


def _build_tiny(arch: str, root: Path) -> TinyModel:
    torch.manual_seed(0)
    model = _model_class(arch)(_tiny_config(arch)).eval()
    path = root / arch
    model.save_pretrained(path, safe_serialization=True)
    gen = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, TINY_VOCAB, (n,), generator=gen).tolist() for n in TINY_PROMPT_LENS]
    model.generation_config.eos_token_id = None  # run the full TINY_MAX_NEW tokens, as ignore_eos does
    outs = []
    with torch.inference_mode():
        for p in prompts:
            seq = model.generate(
                torch.tensor([p]),
                attention_mask=torch.ones(1, len(p), dtype=torch.long),
                max_new_tokens=TINY_MAX_NEW,
                do_sample=False,
                eos_token_id=None,
                pad_token_id=0,
            )
            outs.append(seq[0, len(p) :].tolist())
    assert all(len(o) == TINY_MAX_NEW for o in outs)
    return TinyModel(arch, path, prompts, outs)


@pytest.fixture(scope="session")
def tiny_model_factory(tmp_path_factory):
    """`get(arch)` -> a TinyModel, built (and its HF outputs computed) once per session."""
    cache: dict[str, TinyModel] = {}
    root = tmp_path_factory.mktemp("tiny-models")

    def get(arch: str) -> TinyModel:
        if arch not in cache:
            cache[arch] = _build_tiny(arch, root)
        return cache[arch]

    return get
