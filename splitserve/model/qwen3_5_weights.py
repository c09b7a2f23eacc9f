"""Qwen3.5 checkpoint names <-> Qwen3_5LM's parameters: which HF projections are merged into which of our
weights (by rows), the mapping of one name, the keys a checkpoint must fill, and the inverse (our
parameters under HF names, for build_hf_model and save_hf_checkpoint)."""

from __future__ import annotations

import torch
from torch import nn

from splitserve.model.config import ModelConfig

Merged = dict[str, tuple[str, tuple[int, int]]]


def merged_rows(cfg: ModelConfig) -> Merged:
    """HF module name -> (our merged module, its row range there), for every merged projection."""
    lin = cfg.linear
    assert lin is not None
    q, kv = 2 * cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim  # q: [query | gate]
    value = lin.num_value_heads * lin.value_head_dim
    pieces = {
        "qkv_proj": [("q_proj", q), ("k_proj", kv), ("v_proj", kv)],
        "in_proj": [
            ("in_proj_qkv", lin.conv_dim),
            ("in_proj_z", value),
            ("in_proj_b", lin.num_value_heads),
            ("in_proj_a", lin.num_value_heads),
        ],
        "gate_up_proj": [("gate_proj", cfg.intermediate_size), ("up_proj", cfg.intermediate_size)],
    }
    out: Merged = {}
    for target, parts in pieces.items():
        start = 0
        for hf_module, size in parts:
            out[hf_module] = (target, (start, start + size))
            start += size
    return out


def map_name(name: str, merged: Merged) -> tuple[str | None, tuple[int, int] | None]:
    """HF parameter name -> (our parameter name, row range inside a merged weight or None)."""
    if name.startswith(("mtp.", "model.visual.")) or "rotary_emb" in name:
        return None, None
    for prefix in ("model.language_model.", "model."):
        if name.startswith(prefix):
            name = name[len(prefix) :]
            break
    return map_layer_name(name, merged)


def map_layer_name(name: str, merged: Merged) -> tuple[str | None, tuple[int, int] | None]:
    """A name below the model's prefix (`layers.N.self_attn.q_proj.weight`, `norm.weight`) -> (ours,
    row range inside a merged weight or None)."""
    parts = name.split(".")
    if len(parts) >= 5 and parts[0] == "layers" and parts[3] in merged:
        target, rows = merged[parts[3]]
        return ".".join([*parts[:3], target, *parts[4:]]), rows
    return name, None


def expected_keys(model: nn.Module, merged: Merged) -> list[str]:
    rows_of: dict[str, list[tuple[int, int]]] = {}
    for target, rows in merged.values():
        rows_of.setdefault(target, []).append(rows)
    keys = []
    for name, _ in model.named_parameters():
        parts = name.split(".")
        if parts[0] == "layers" and len(parts) >= 5 and parts[3] in rows_of:
            keys += [f"{name}:{r}" for r in rows_of[parts[3]]]
        else:
            keys.append(f"{name}:None")
    return keys


def hf_named(model: nn.Module, merged: Merged, prefix: str = "model.") -> dict[str, torch.Tensor]:
    """`model`'s parameters under `Qwen3_5ForCausalLM` names (`prefix`: where its layers live; `mtp.`
    for the MTP head), merged weights split by rows (views)."""
    parts: dict[str, list[tuple[str, tuple[int, int]]]] = {}
    for hf_module, (target, rows) in merged.items():
        parts.setdefault(target, []).append((hf_module, rows))
    out: dict[str, torch.Tensor] = {}
    for name, param in model.named_parameters():
        t, pieces = param.detach(), name.split(".")
        if len(pieces) >= 5 and pieces[0] == "layers" and pieces[3] in parts:
            for hf_module, (a, b) in parts[pieces[3]]:
                out[prefix + ".".join([*pieces[:3], hf_module, *pieces[4:]])] = t[a:b]
        else:
            out[name if name.startswith("lm_head.") else f"{prefix}{name}"] = t
    return out
