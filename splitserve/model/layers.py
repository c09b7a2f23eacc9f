"""Building blocks shared by the decoder families: RMSNorm, rotary embedding, gated MLP, and for
Qwen3.5 a zero-centred RMSNorm, a gated RMSNorm and partial (leading-dims) rotary embedding.

Each is written to match Hugging Face transformers' arithmetic step for step (fp32 norm statistics,
cos/sin computed in fp32 from the same inverse frequencies), so that greedy output is token-exact
against HF on the same weights.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from splitserve.model.config import RopeConfig

if TYPE_CHECKING:
    from splitserve.kernels.gemv import NormedRow


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and x.device.type == "cpu":
            # torch's fused CPU kernel: one pass instead of five (a 2,048-token prefill's norm 3x faster)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(dtype)


class ZeroCentredRMSNorm(nn.Module):
    """RMSNorm whose weight is stored as an offset from 1 (Qwen3.5): `norm(x) * (1 + w)`, all in fp32,
    then cast back (the product is taken before the cast, unlike `RMSNorm`)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """`weight * norm(x) * silu(gate)` over the last dim (Qwen3.5's Gated DeltaNet output norm)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        h = self.weight * h.to(dtype)
        return (h * F.silu(gate.float())).to(dtype)


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
        if torch.empty(0).device.type == "meta":
            # A skeleton built on `meta` (load_model) gets its tables from build_rope later; computing
            # them on meta would import PyTorch's Python reference ops (and dynamo): a second or more.
            cos = sin = torch.empty(max_positions, rotary_dim)
        else:
            inv_freq = rope_inv_freq(cfg, rotary_dim)
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim // 2]
            emb = torch.cat((freqs, freqs), dim=-1)
            cos, sin = emb.cos(), emb.sin()
        self.register_buffer("cos", cos, persistent=False)  # [max_positions, rotary_dim]
        self.register_buffer("sin", sin, persistent=False)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, H, D]; k [T, KVH, D]
        if q.device.type == "cpu" and q.dtype == k.dtype == self.cos.dtype == torch.float32:
            half = self.cos.shape[-1] // 2  # the table's two halves are equal (cat(freqs, freqs))
            cos_h, sin_h = self.cos[positions, :half].unsqueeze(1), self.sin[positions, :half].unsqueeze(1)
            return _apply_halves(q, cos_h, sin_h), _apply_halves(k, cos_h, sin_h)
        cos = self.cos[positions].to(q.dtype).unsqueeze(1)  # [T, 1, D]
        sin = self.sin[positions].to(q.dtype).unsqueeze(1)
        return _apply(q, cos, sin), _apply(k, cos, sin)


class PartialRotaryEmbedding(nn.Module):
    """Neox-style rotary embedding on the first `rotary_dim` dims of each head; the rest pass through.

    The cos/sin tables are computed on the CPU at construction (even under a `meta` device context)
    and kept as plain attributes, not buffers, so a model built on `meta` and materialized with
    `to_empty` needs no extra step; they are copied to a device on first use there.
    """

    def __init__(self, cfg: RopeConfig, rotary_dim: int, max_positions: int) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        with torch.device("cpu"):
            inv_freq = rope_inv_freq(cfg, rotary_dim)
            positions = torch.arange(max_positions, dtype=torch.float32)
            freqs = positions[:, None] * inv_freq[None, :]  # [max_positions, rotary_dim // 2]
            emb = torch.cat((freqs, freqs), dim=-1)
            self._tables = {torch.device("cpu"): (emb.cos(), emb.sin())}  # [max_positions, rotary_dim]

    def tables(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        if device not in self._tables:
            cos, sin = self._tables[torch.device("cpu")]
            with torch.inference_mode(False):
                self._tables[device] = (cos.to(device), sin.to(device))
        return self._tables[device]

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        # positions [T]; q [T, H, D]; k [T, KVH, D]
        cos_table, sin_table = self.tables(q.device)
        cos = cos_table[positions].to(q.dtype).unsqueeze(1)  # [T, 1, rotary_dim]
        sin = sin_table[positions].to(q.dtype).unsqueeze(1)
        r = self.rotary_dim
        q = torch.cat((_apply(q[..., :r], cos, sin), q[..., r:]), dim=-1)
        k = torch.cat((_apply(k[..., :r], cos, sin), k[..., r:]), dim=-1)
        return q, k


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return (x * cos) + (_rotate_half(x) * sin)


def _apply_halves(x: torch.Tensor, cos_h: torch.Tensor, sin_h: torch.Tensor) -> torch.Tensor:
    """`_apply` with the cos/sin of one half (CPU): the same products and sums, so the same bits
    (x1 c + (-x2) s is x1 c - x2 s exactly), with two half-size temporaries instead of four full-size
    ones and a concatenation. x [T, H, D] (a view of the QKV projection is fine) -> a fresh tensor."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    out = torch.empty(x.shape, dtype=x.dtype)
    torch.mul(x1, cos_h, out=out[..., :half]).sub_(x2 * sin_h)
    torch.mul(x2, cos_h, out=out[..., half:]).add_(x1 * sin_h)
    return out


def linear(
    x: torch.Tensor | NormedRow, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """F.linear, with a one-row CUDA input of 16-bit weights (batch-1 decode) through kernels/gemv.py,
    which reads the weight faster than cuBLAS's M = 1 kernels (`bench/gemv.py`). `x` may be a
    `NormedRow` (the decoder's batch-1 fused forward): the GEMV normalizes it as it reads it."""
    if isinstance(x, torch.Tensor) and not (x.is_cuda and x.shape[0] == 1):
        return F.linear(x, weight, bias)
    from splitserve.kernels import gemv

    if isinstance(x, gemv.NormedRow):
        if gemv.ENABLED and gemv.use_gemv(x.residual, weight):
            return gemv.gemv_normed(x, weight, bias)
        x = x.materialize()
    if gemv.ENABLED and gemv.use_gemv(x, weight):
        return gemv.gemv(x, weight, bias)
    return F.linear(x, weight, bias)


class Linear(nn.Linear):
    """nn.Linear through `linear`, or on CPU through `cpu_matmul` when `kernels/cpu/linear.py` set one."""

    # CPU: the weight packed for oneDNN or quantized, as a callable x -> x @ W.T + b (kernels/cpu/linear.py)
    cpu_matmul: Callable[[torch.Tensor], torch.Tensor] | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.cpu_matmul is not None and isinstance(x, torch.Tensor):
            return self.cpu_matmul(x)
        return linear(x, self.weight, self.bias)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)) with gate and up merged into one matmul."""

    def __init__(self, hidden: int, intermediate: int) -> None:
        super().__init__()
        self.gate_up_proj = Linear(hidden, 2 * intermediate, bias=False)
        self.down_proj = Linear(intermediate, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.gate_up_proj(x)
        gate, up = h.chunk(2, dim=-1)
        if h.device.type == "cpu" and not torch.is_grad_enabled():
            # in place, into the gate half: no two fresh [T, intermediate] tensors per layer (a prefill
            # step's are 12 MB each, fresh pages every time); the same values as the line below
            return self.down_proj(F.silu(gate, inplace=True).mul_(up))
        return self.down_proj(F.silu(gate) * up)
