"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, gated MLP.

Each is written to match Hugging Face transformers' arithmetic step for step (fp32 norm statistics,
cos/sin computed in fp32 from the same inverse frequencies), so that greedy output is token-exact
against HF on the same weights.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.config import RopeConfig


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


def rope_inv_freq(cfg: RopeConfig, rotary_dim: int) -> torch.Tensor:
    """Inverse frequencies [rotary_dim // 2], fp32, as transformers computes them."""
    exponents = torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim
    inv_freq = 1.0 / (cfg.theta**exponents)
    if cfg.kind == "linear":
        return inv_freq / cfg.factor
    if cfg.kind == "llama3":
        return _llama3_scale(inv_freq, cfg)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, cfg: RopeConfig) -> torch.Tensor:
    old_len = cfg.original_max_position
    low_wavelen = old_len / cfg.low_freq_factor
    high_wavelen = old_len / cfg.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / cfg.factor, inv_freq)
    smooth = (old_len / wavelen - cfg.low_freq_factor) / (cfg.high_freq_factor - cfg.low_freq_factor)
    smoothed = (1 - smooth) * scaled / cfg.factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding (rotate_half) with a precomputed cos/sin table."""

    def __init__(self, cfg: RopeConfig, rotary_dim: int, max_positions: int) -> None:
        super().__init__()
        inv_freq = rope_inv_freq(cfg, rotary_dim)
        positions = torch.arange(max_positions, dtype=torch.float32)
        freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim // 2]
        emb = torch.cat((freqs, freqs), dim=-1)
        self.register_buffer("cos", emb.cos(), persistent=False)  # [max_positions, rotary_dim]
        self.register_buffer("sin", emb.sin(), persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, H, D]; k [T, KVH, D]
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (_rotate_half(x) * sin)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up merged into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)
