"""Tensor parallelism for the model families: one rank's shard of a model, built from the full weights.

A rank runs the same model class as an unsharded engine, built from a *shard config* (`shard_config`):
each count that is split across ranks is divided by the group size, so the KV cache and the
recurrent-state pools the engine sizes from that config are this rank's heads only.

    attention     q heads split; KV heads split, or replicated (one per rank) when fewer than ranks;
                  qkv_proj column-parallel (its rows), o_proj row-parallel (its columns) + all-reduce
    MLP           gate_up_proj column-parallel, down_proj row-parallel + all-reduce
    Gated DeltaNet key and value heads split: in_proj's q, k, v, z, b, a rows, the conv channels, dt_bias
                  and A_log by head; out_proj row-parallel + all-reduce; the recurrent state by value head
    embedding     vocabulary-parallel: each rank holds ceil(V / n) rows, looks up its own ids, all-reduce
    LM head       vocabulary-parallel: each rank's logits for its rows, all-gathered into [N, V]

`shard_tensor` cuts one full tensor (under its Hugging Face name) into a rank's piece; `shard_model`
builds a rank's model from a full one. Norm weights and biases of row-parallel layers are replicated
(a row-parallel bias is added on rank 0 only, so the all-reduce adds it once).

The collectives go through a `Collectives` object (engine/tp/group.py gives one over torch.distributed:
gloo on the CPU, NCCL on CUDA), so this module knows no process group.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.config import ModelConfig
from splitserve.model.layers import Linear


class Collectives(Protocol):
    rank: int
    size: int

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor: ...  # in place, returns x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor: ...  # concatenated on the last dim


def check_divisible(cfg: ModelConfig, size: int) -> None:
    """Raise ValueError naming the first dimension that `size` ranks cannot split."""
    checks = [
        ("num_attention_heads", cfg.num_heads, cfg.num_heads % size == 0),
        (
            "num_key_value_heads",
            cfg.num_kv_heads,
            cfg.num_kv_heads % size == 0 or size % cfg.num_kv_heads == 0,
        ),
        ("intermediate_size", cfg.intermediate_size, cfg.intermediate_size % size == 0),
    ]
    if cfg.linear is not None:
        checks.append(
            ("linear_num_key_heads", cfg.linear.num_key_heads, cfg.linear.num_key_heads % size == 0)
        )
        checks.append(
            ("linear_num_value_heads", cfg.linear.num_value_heads, cfg.linear.num_value_heads % size == 0)
        )
    for name, value, ok in checks:
        if not ok:
            raise ValueError(
                f"tensor_parallel_size {size} does not divide {cfg.architecture}'s {name} ({value})"
            )


def shard_config(cfg: ModelConfig, size: int) -> ModelConfig:
    """The config one of `size` ranks builds its model, KV cache and state pools from."""
    check_divisible(cfg, size)
    if size == 1:
        return cfg
    linear = cfg.linear
    if linear is not None:
        linear = replace(
            linear, num_key_heads=linear.num_key_heads // size, num_value_heads=linear.num_value_heads // size
        )
    return replace(
        cfg,
        num_heads=cfg.num_heads // size,
        num_kv_heads=max(1, cfg.num_kv_heads // size),
        intermediate_size=cfg.intermediate_size // size,
        linear=linear,
    )


def kv_heads_of(cfg: ModelConfig, size: int, rank: int) -> tuple[int, int]:
    """The KV heads [start, end) rank `rank` of `size` holds (one shared head when fewer than ranks)."""
    if cfg.num_kv_heads >= size:
        per = cfg.num_kv_heads // size
        return rank * per, (rank + 1) * per
    head = rank * cfg.num_kv_heads // size
    return head, head + 1


def kv_head_index(cfg: ModelConfig, size: int, rank: int) -> list[int]:
    """The model's KV heads rank `rank` of `size` holds, in the order of its cache's head axis."""
    return list(range(*kv_heads_of(cfg, size, rank)))


def state_index(cfg: ModelConfig, size: int, rank: int) -> dict[str, tuple[int, list[int], int]]:
    """For each recurrent-state tensor (the model's `state_shapes` names): (the axis split across ranks,
    the model's channels along it that rank `rank` holds, in its order, the model's count of them).
    Axis 0 of each is the layer; the Gated DeltaNet conv window holds q, k and v channels, the
    recurrent state one matrix per value head."""
    lin = cfg.linear
    if lin is None:
        return {}
    kh, vh = _split(lin.num_key_heads, size, rank), _split(lin.num_value_heads, size, rank)
    dk, dv, key = lin.key_head_dim, lin.value_head_dim, lin.num_key_heads * lin.key_head_dim
    conv = [*range(kh[0] * dk, kh[1] * dk), *range(key + kh[0] * dk, key + kh[1] * dk),
            *range(2 * key + vh[0] * dv, 2 * key + vh[1] * dv)]  # fmt: skip
    return {"conv": (1, conv, lin.conv_dim), "recurrent": (1, list(range(*vh)), lin.num_value_heads)}


def vocab_rows(vocab: int, size: int, rank: int) -> tuple[int, int, int]:
    """(first id, ids held, rows per rank): each rank holds ceil(V / n) rows, the last padded."""
    per = -(-vocab // size)
    start = min(rank * per, vocab)
    return start, min(vocab, start + per) - start, per


def _rows(t: torch.Tensor, ranges: list[tuple[int, int]]) -> torch.Tensor:
    return torch.cat([t[a:b] for a, b in ranges]) if len(ranges) > 1 else t[ranges[0][0] : ranges[0][1]]


def _split(n: int, size: int, rank: int) -> tuple[int, int]:
    return rank * n // size, (rank + 1) * n // size


def shard_tensor(name: str, t: torch.Tensor, cfg: ModelConfig, size: int, rank: int) -> torch.Tensor:
    """Rank `rank`'s piece of the full tensor `t`, stored under the Hugging Face name `name`."""
    parts = name.split(".")
    leaf, module = parts[-1], parts[-2] if len(parts) > 1 else ""
    d, lin = cfg.head_dim, cfg.linear
    heads = _split(cfg.num_heads, size, rank)
    if module in ("embed_tokens", "lm_head"):
        start, n, per = vocab_rows(cfg.vocab_size, size, rank)
        return F.pad(t[start : start + n], (0, 0, 0, per - n))
    if module == "q_proj":  # Qwen3.5: per head [query | gate]
        width = d * (2 if cfg.is_hybrid else 1)
        return t[heads[0] * width : heads[1] * width]
    if module in ("k_proj", "v_proj"):
        a, b = kv_heads_of(cfg, size, rank)
        return t[a * d : b * d]
    if module == "o_proj":
        return t[:, heads[0] * d : heads[1] * d] if leaf == "weight" else _rank0_bias(t, rank)
    if module in ("gate_proj", "up_proj"):
        return t[slice(*_split(cfg.intermediate_size, size, rank))]
    if module == "down_proj":
        return (
            t[:, slice(*_split(cfg.intermediate_size, size, rank))]
            if leaf == "weight"
            else _rank0_bias(t, rank)
        )
    if lin is None or "linear_attn" not in parts:
        return t  # norms
    kh, vh = _split(lin.num_key_heads, size, rank), _split(lin.num_value_heads, size, rank)
    dk, dv, key = lin.key_head_dim, lin.value_head_dim, lin.num_key_heads * lin.key_head_dim
    if leaf in ("dt_bias", "A_log") or module in ("in_proj_b", "in_proj_a"):
        return t[vh[0] : vh[1]]
    if module in ("in_proj_qkv", "conv1d"):  # channels: q (Hk * Dk), k (Hk * Dk), v (Hv * Dv)
        return _rows(t, [(kh[0] * dk, kh[1] * dk), (key + kh[0] * dk, key + kh[1] * dk),
                         (2 * key + vh[0] * dv, 2 * key + vh[1] * dv)])  # fmt: skip
    if module == "in_proj_z":
        return t[vh[0] * dv : vh[1] * dv]
    if module == "out_proj":
        return t[:, vh[0] * dv : vh[1] * dv]
    return t  # the gated norm's weight (per value-head dim)


def _rank0_bias(t: torch.Tensor, rank: int) -> torch.Tensor:
    return t if rank == 0 else torch.zeros_like(t)


class RowParallelLinear(Linear):
    """A projection whose input features are split across ranks: the partial products are summed."""

    tp: Collectives

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.tp.all_reduce(super().forward(x))


class VocabParallelEmbedding(nn.Module):
    """This rank's rows of the embedding; ids it does not hold look up zeros, then an all-reduce."""

    def __init__(self, start: int, held: int, rows: int, hidden: int, tp: Collectives) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(rows, hidden))
        self.start, self.held, self.tp = start, held, tp

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.held)  # [T]
        out = F.embedding(local.masked_fill(outside, 0), self.weight)  # [T, hidden]
        return self.tp.all_reduce(out.masked_fill_(outside[:, None], 0.0))


def gather_logits(model: nn.Module, logits: torch.Tensor) -> torch.Tensor:
    """[N, V / n] logits of this rank's vocabulary rows -> [N, V] on every rank (no-op without TP)."""
    tp: Collectives | None = getattr(model, "tp", None)
    if tp is None:
        return logits
    return tp.all_gather_last(logits.contiguous())[:, : model.cfg.vocab_size]


def parallelize_(model: nn.Module, tp: Collectives) -> None:
    """Swap a (meta) model's row-parallel projections, embedding and LM head for their parallel forms,
    sized from `model.cfg` (a shard config with the full vocabulary)."""
    cfg = model.cfg
    for layer in model.layers:
        mixer = getattr(layer, "self_attn", None) or layer.linear_attn
        name = "o_proj" if hasattr(mixer, "o_proj") else "out_proj"
        setattr(mixer, name, _row_parallel(getattr(mixer, name), tp))
        layer.mlp.down_proj = _row_parallel(layer.mlp.down_proj, tp)
    start, held, rows = vocab_rows(cfg.vocab_size, tp.size, tp.rank)
    model.embed_tokens = VocabParallelEmbedding(start, held, rows, cfg.hidden_size, tp)
    if model.lm_head is not None:
        model.lm_head = nn.Linear(cfg.hidden_size, rows, bias=False)
    model.tp = tp


def _row_parallel(proj: Linear, tp: Collectives) -> RowParallelLinear:
    out = RowParallelLinear(proj.in_features, proj.out_features, bias=proj.bias is not None)
    out.tp = tp
    return out


def shard_model(
    full: nn.Module,
    named: dict[str, torch.Tensor],
    tp: Collectives,
    device: torch.device,
    max_positions: int,
) -> nn.Module:
    """Rank `tp.rank`'s model: built on `meta` from the shard config of `full` (the unsharded model), then
    filled from `named`, `full`'s weights under Hugging Face names (random_weights.hf_state_dict)."""
    cfg = shard_config(full.cfg, tp.size)
    dtype = next(full.parameters()).dtype
    with torch.device("meta"):
        model = type(full)(cfg, max_positions)
        parallelize_(model, tp)
        model = model.to(dtype)
    model = model.to_empty(device=device)
    pieces = (
        (name, shard_tensor(name, t, full.cfg, tp.size, tp.rank).to(device)) for name, t in named.items()
    )
    with torch.no_grad():
        model.load_weights(pieces)
    model.build_rope(max_positions, device)
    return model.eval()


__all__ = [
    "Collectives",
    "RowParallelLinear",
    "VocabParallelEmbedding",
    "check_divisible",
    "gather_logits",
    "kv_head_index",
    "kv_heads_of",
    "parallelize_",
    "shard_config",
    "shard_model",
    "shard_tensor",
    "state_index",
    "vocab_rows",
]
