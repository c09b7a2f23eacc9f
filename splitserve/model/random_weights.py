"""Models with random weights at a given HF-style config, built straight on the target device.

No checkpoint is read: the model is constructed on the meta device, materialized with `to_empty` on
the target device and dtype, and initialized in place (linear and embedding weights ~ N(0, std),
biases 0, norm weights 1), so an 8B model in bf16 appears on a GPU in a second or two. Used by
benchmarks that need a model's shape, not its knowledge.

`hf_state_dict` and `build_hf_model` give Hugging Face transformers the very same weights (merged
`qkv_proj` / `gate_up_proj` split back into q/k/v and gate/up), for side-by-side comparisons.

Only torch is needed here (transformers only inside `build_hf_model`); nothing imports `gguf`.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch import nn

from splitserve.model.checkpoint import RANDOM_SOURCE
from splitserve.model.config import ModelConfig
from splitserve.model.decoder import DecoderLM
from splitserve.model.loader import LoadedModel
from splitserve.model.registry import MODEL_CLASSES, resolve_architecture

#: Qwen3-8B (config.json of Qwen/Qwen3-8B, HF names).
QWEN3_8B: dict[str, Any] = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "vocab_size": 151936,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "max_position_embeddings": 40960,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}

#: Qwen3-1.7B (config.json of Qwen/Qwen3-1.7B, HF names): 1.7B parameters, 3.4 GB in bf16.
QWEN3_1_7B: dict[str, Any] = {
    **QWEN3_8B,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "num_hidden_layers": 28,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "tie_word_embeddings": True,
}

#: A Qwen3-shaped model small enough for unit tests and CPU smoke runs.
TINY_QWEN3: dict[str, Any] = {
    **QWEN3_8B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: TINY_QWEN3 with the default tokenizer's whole vocabulary (SmolLM2's 49152 ids, `<|im_end|>` = 2): chat
#: prompts through the real chat template fit it, and its free text is noise (structured-output tests).
TINY_CHAT: dict[str, Any] = {**TINY_QWEN3, "vocab_size": 49152}

#: The GPU tests' small Qwen3 (tests/gpu, bench/bf16_agreement.py): HF `Qwen3Config` fields; the
#: weights' scale (`initializer_range`) is each caller's.
SMALL_QWEN3: dict[str, Any] = {
    "vocab_size": 1000,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 1024,
}

#: The GPU tests' small Qwen3.5 (tests/gpu, bench/gdn_fla_precision.py): HF `Qwen3_5TextConfig` fields,
#: four layers (three Gated DeltaNet, one full attention).
SMALL_QWEN3_5: dict[str, Any] = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "initializer_range": 0.1,
    "max_position_embeddings": 1024,
}

#: Qwen3.5-9B's text model (transformers' `Qwen3_5TextConfig` defaults, HF names): 32 layers, every
#: fourth gated full attention (16 heads, 4 KV heads, head_dim 256), the others Gated DeltaNet (16 key
#: and 32 value heads of 128); 248,320-token vocabulary. Qwen3_5LM reads only the language model.
QWEN3_5_9B: dict[str, Any] = {
    "architectures": ["Qwen3_5ForCausalLM"],
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 32,
    "full_attention_interval": 4,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 256,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_key_head_dim": 128,
    "linear_value_head_dim": 128,
    "linear_conv_kernel_dim": 4,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.25},
    "max_position_embeddings": 32768,
    "tie_word_embeddings": False,
    "attention_bias": False,
    "mtp_num_hidden_layers": 1,  # the multi-token-prediction head (model/qwen3_5_mtp.py)
}

#: A small hybrid (8 layers: 6 Gated DeltaNet, 2 gated attention; a one-layer MTP head) for CPU smoke runs
#: and unit tests.
TINY_QWEN3_5: dict[str, Any] = {
    **QWEN3_5_9B,
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 8,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 16,
    "linear_value_head_dim": 32,
    "max_position_embeddings": 4096,
}

#: A small Llama with one KV head (shared by every tensor-parallel rank) and an odd vocabulary (the last
#: rank's rows of a vocabulary-parallel embedding and LM head padded).
TINY_LLAMA: dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 509,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "rms_norm_eps": 1e-5,
    "rope_theta": 10000.0,
    "max_position_embeddings": 4096,
    "tie_word_embeddings": False,
    "bos_token_id": 1,
    "eos_token_id": 2,
}

#: A mid-size Qwen3 shape (165M parameters) for CPU benchmarks whose products must be real work, e.g.
#: each rank's half of them under tensor parallelism (bench/tp_decode_step.py).
QWEN3_MINI: dict[str, Any] = {
    **TINY_QWEN3,
    "vocab_size": 32000,
    "hidden_size": 1024,
    "intermediate_size": 3072,
    "num_hidden_layers": 8,
    "num_attention_heads": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
}

#: Names accepted by `random_model_config` (and the benchmarks' `--model`).
RANDOM_SHAPES: dict[str, dict[str, Any]] = {
    "qwen3-8b-random": QWEN3_8B,
    "qwen3-1.7b-random": QWEN3_1_7B,
    "tiny-random": TINY_QWEN3,
    "tiny-llama-random": TINY_LLAMA,
    "qwen3-mini-random": QWEN3_MINI,
    "tiny-chat-random": TINY_CHAT,
    "qwen3.5-9b-random": QWEN3_5_9B,
    "qwen3.5-tiny-random": TINY_QWEN3_5,
}


def random_source_config(source: str) -> dict[str, Any]:
    """The HF config of a `random:SHAPE` source; SHAPE is a `RANDOM_SHAPES` name, "-random" optional."""
    name = str(source).removeprefix(RANDOM_SOURCE)
    if name not in RANDOM_SHAPES and f"{name}-random" in RANDOM_SHAPES:
        name = f"{name}-random"
    if name not in RANDOM_SHAPES:
        known = ", ".join(RANDOM_SOURCE + k.removesuffix("-random") for k in RANDOM_SHAPES)
        raise ValueError(f"unknown random model {source!r}; known: {known}")
    return random_model_config(name)


def random_model_config(name: str) -> dict[str, Any]:
    """A copy of the named shape's HF config dict; KeyError lists the known names."""
    if name not in RANDOM_SHAPES:
        raise KeyError(f"unknown random model {name!r}; known: {', '.join(RANDOM_SHAPES)}")
    return dict(RANDOM_SHAPES[name])


def random_model(
    hf_config: dict[str, Any],
    device: torch.device | str,
    dtype: torch.dtype,
    max_positions: int | Callable[[ModelConfig], int] | None = None,
    seed: int = 0,
    std: float = 0.02,
) -> LoadedModel:
    """A `LoadedModel` (checkpoint=None) with random weights of `hf_config`'s shape on `device`.

    `max_positions`: rotary table length, an int or (like `load_model`) a function of the config;
    None means min(max_position_embeddings, 8192).
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    arch = resolve_architecture(hf_config)
    cfg = ModelConfig.from_hf({**hf_config, "architectures": [arch]})
    if max_positions is None:
        positions = min(cfg.max_position_embeddings, 8192)
    else:
        positions = max_positions if isinstance(max_positions, int) else max_positions(cfg)
    with torch.device("meta"):
        model = MODEL_CLASSES[arch](cfg, positions).to(dtype)
    model = model.to_empty(device=device)
    init_random_(model, seed, std)
    # cos/sin are computed, not random, and stay fp32 (as load_model leaves them)
    model.build_rope(positions, device)
    model.eval()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    seconds = time.perf_counter() - t0
    stats = {"method": "random", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
             "total_seconds": round(seconds, 4), "seed": seed, "std": std}  # fmt: skip
    return LoadedModel(model, cfg, None, seconds, stats)


@torch.no_grad()
def init_random_(model: nn.Module, seed: int = 0, std: float = 0.02) -> None:
    """In place: norm weights at identity scale (1, or 0 for a norm that stores 1 + w), biases 0,
    Gated DeltaNet decay parameters as HF initializes them (A_log = log U(1, 16), dt_bias = 1), every
    other parameter ~ N(0, std), from one seeded generator."""
    first = next(model.parameters())
    gen = torch.Generator(device=first.device)
    gen.manual_seed(seed)
    for module in model.modules():
        kind = type(module).__name__
        for name, param in module.named_parameters(recurse=False):
            if "Norm" in kind and name == "weight":
                param.fill_(0.0 if kind.startswith("ZeroCentred") else 1.0)
            elif name == "bias":
                param.zero_()
            elif name == "A_log":
                param.uniform_(1.0, 16.0, generator=gen).log_()
            elif name == "dt_bias":
                param.fill_(1.0)
            else:
                param.normal_(0.0, std, generator=gen)


def hf_state_dict(model: DecoderLM) -> dict[str, torch.Tensor]:
    """Our parameters under HF names and layouts (views, no copies); the inverse of `load_weights`.

    Merged weights are split by rows: qkv_proj -> q_proj/k_proj/v_proj and gate_up_proj ->
    gate_proj/up_proj. A tied model has no `lm_head.weight` (HF ties it to the embedding).
    """
    if hasattr(model, "hf_state_dict"):  # models with their own merged layouts (Qwen3.5)
        return model.hf_state_dict()
    cfg = model.cfg
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        t = param.detach()
        prefix, _, leaf = name.rpartition(".")  # leaf: weight | bias
        if name.startswith("lm_head."):
            out[name] = t
        elif prefix.endswith(".qkv_proj"):
            base = prefix[: -len("qkv_proj")]
            rows = {"q_proj": (0, q), "k_proj": (q, q + kv), "v_proj": (q + kv, q + 2 * kv)}
            for part, (a, b) in rows.items():
                out[f"model.{base}{part}.{leaf}"] = t[a:b]
        elif prefix.endswith(".gate_up_proj"):
            base = prefix[: -len("gate_up_proj")]
            n = cfg.intermediate_size
            out[f"model.{base}gate_proj.{leaf}"] = t[:n]
            out[f"model.{base}up_proj.{leaf}"] = t[n:]
        else:
            out[f"model.{name}"] = t
    return out


def build_hf_model(hf_config: dict[str, Any], model: DecoderLM) -> nn.Module:
    """An HF transformers `AutoModelForCausalLM` of `hf_config` holding a copy of `model`'s weights.

    Built on `model`'s device and dtype; every HF parameter must be covered (strict load).
    """
    from transformers import AutoConfig, AutoModelForCausalLM

    first = next(model.parameters())
    kwargs = {k: v for k, v in hf_config.items() if k != "model_type"}
    config = AutoConfig.for_model(hf_config.get("model_type", model.cfg.model_type), **kwargs)
    with torch.device(first.device):
        hf = AutoModelForCausalLM.from_config(config, dtype=first.dtype)
    hf.load_state_dict(hf_state_dict(model), strict=True)
    return hf.eval()


def save_hf_checkpoint(
    model: DecoderLM,
    hf_config: dict[str, Any],
    directory: str | os.PathLike[str],
    dtype: torch.dtype | None = None,
    shard_bytes: int = 5 * 10**9,
    progress: bool = True,
) -> Path:
    """Write `model`'s weights as a Hugging Face safetensors directory (config.json, shards, index).

    Tensors are copied to the CPU one shard at a time (`dtype`: cast them, default: the model's), so
    an 8B model on a GPU needs only about one shard of host memory.
    """
    from safetensors.torch import save_file
    from tqdm.auto import tqdm

    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    tensors = hf_state_dict(model)
    first = next(iter(tensors.values()))
    dtype = dtype or first.dtype
    groups: list[list[str]] = [[]]
    size = 0
    for name, t in tensors.items():
        nbytes = t.numel() * dtype.itemsize
        if groups[-1] and size + nbytes > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    n = len(groups)
    files = (
        ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]
    )
    weight_map: dict[str, str] = {}
    total = 0
    for file, names in tqdm(
        list(zip(files, groups, strict=True)), desc="saving shards", disable=not progress
    ):
        shard = {name: tensors[name].detach().to("cpu", dtype, copy=True).contiguous() for name in names}
        total += sum(t.numel() * t.element_size() for t in shard.values())
        save_file(shard, str(out / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(names, file))
        del shard
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
    config = {**hf_config, "torch_dtype": str(dtype).removeprefix("torch.")}
    (out / "config.json").write_text(json.dumps(config, indent=2))
    return out
