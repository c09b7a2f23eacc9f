"""The gated delta rule (Gated DeltaNet linear attention), in plain torch: a chunked form for
prefill and a token-by-token recurrent form for decode. Both are the reference for later GPU kernels.

Per value head, with a state S of shape [Dk, Dv], each token t (query q, key k, value v, log-decay
g <= 0 and learning rate beta in (0, 1)) does

    S  = exp(g) * S                          decay
    S += k (beta * (v - S^T k))^T            delta rule: move S^T k towards v
    o  = S^T q                               read

Queries and keys are L2-normalized (`use_qk_l2norm`) and queries scaled by Dk**-0.5. Grouped heads:
each query/key head serves Hv // Hk consecutive value heads.

Shapes (B sequences, T tokens):

    q, k    [B, T, Hk, Dk]
    v       [B, T, Hv, Dv]
    g, beta [B, T, Hv]
    state   [B, Hv, Dk, Dv]   fp32 (initial_state in, final state out)
    output  [B, T, Hv, Dv]    in q's dtype

All arithmetic is fp32 and follows Hugging Face transformers' `torch_chunk_gated_delta_rule` /
`torch_recurrent_gated_delta_rule` operation for operation, so that results agree to rounding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _heads_first_fp32(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    use_qk_l2norm: bool,
) -> tuple[torch.Tensor, ...]:
    """Expand key heads to value heads and return fp32 [B, Hv, T, ...] tensors (q, k l2-normalized)."""
    hk, hv = k.shape[2], v.shape[2]
    if hk != hv:
        q = q.repeat_interleave(hv // hk, dim=2)
        k = k.repeat_interleave(hv // hk, dim=2)
    q, k, v, g, beta = (
        x.transpose(1, 2).to(torch.float32, memory_format=torch.contiguous_format) for x in (q, k, v, g, beta)
    )
    if use_qk_l2norm:
        q, k = l2norm(q), l2norm(k)
    return q, k, v, g, beta


def _initial_state(
    initial_state: torch.Tensor | None, b: int, h: int, dk: int, dv: int, like: torch.Tensor
) -> torch.Tensor:
    if initial_state is None:
        return torch.zeros((b, h, dk, dv), dtype=torch.float32, device=like.device)
    return initial_state.to(device=like.device, dtype=torch.float32)


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    chunk_size: int = 64,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule over whole sequences, `chunk_size` tokens at a time; returns (output, state).

    Inside a chunk, the sequential delta-rule updates are condensed with the WY (UT-transform)
    representation into a few matmuls and one triangular solve; a short loop over the chunks
    carries the state. The result equals the recurrent form up to rounding, from any initial state,
    so a sequence may be split anywhere into consecutive calls.
    """
    out_dtype = q.dtype
    b, t = q.shape[:2]
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta, use_qk_l2norm)  # [B, H, T, *]
    h, dk, dv = q.shape[1], q.shape[-1], v.shape[-1]
    q = q * dk**-0.5

    # Pad T to a multiple of the chunk: padded tokens have k = v = beta = g = 0, so they neither
    # change the state nor (their outputs being dropped) the result.
    pad = (chunk_size - t % chunk_size) % chunk_size
    q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
    g, beta = (F.pad(x, (0, pad)) for x in (g, beta))
    n = (t + pad) // chunk_size

    k_beta = k * beta.unsqueeze(-1)
    v_beta = v * beta.unsqueeze(-1)
    # [B, H, N, C, D] and [B, H, N, C]
    q, k, k_beta, v_beta = (x.reshape(b, h, n, chunk_size, x.shape[-1]) for x in (q, k, k_beta, v_beta))
    g = g.reshape(b, h, n, chunk_size)

    # cum_g[..., i]: log of the decay from the chunk's start through token i (inclusive)
    cum_g = g.cumsum(dim=-1)
    # decay[..., i, j] = exp(cum_g_i - cum_g_j) for j <= i (decay between tokens j and i), else 0
    upper = torch.ones(chunk_size, chunk_size, dtype=torch.bool, device=q.device).triu(1)
    decay = (cum_g.unsqueeze(-1) - cum_g.unsqueeze(-2)).masked_fill(upper, float("-inf")).exp()  # [B,H,N,C,C]

    # WY representation: with A = I + strictly_lower((K_beta K^T) * decay) (unit lower triangular),
    #   u = A^-1 V_beta                   the values each token writes, before the state's prediction
    #   w = A^-1 (K_beta * exp(cum_g))    how much of the chunk-initial state each token's write removes
    a_mat = (k_beta @ k.transpose(-1, -2)) * decay
    u = torch.linalg.solve_triangular(a_mat, v_beta, upper=False, unitriangular=True)  # [B,H,N,C,Dv]
    w = torch.linalg.solve_triangular(
        a_mat, k_beta * cum_g.exp().unsqueeze(-1), upper=False, unitriangular=True
    )  # [B,H,N,C,Dk]
    intra = (q @ k.transpose(-1, -2)) * decay  # [B,H,N,C,C] causal attention inside the chunk

    q_decayed = q * cum_g.exp().unsqueeze(-1)  # reads of the chunk-initial state
    k_decayed = k * (cum_g[..., -1:] - cum_g).exp().unsqueeze(-1)  # writes, decayed to the chunk's end
    chunk_decay = cum_g[..., -1].exp()[..., None, None]  # [B,H,N,1,1]

    state = _initial_state(initial_state, b, h, dk, dv, q)  # [B, H, Dk, Dv]
    out = torch.zeros_like(u)
    for c in range(n):
        v_new = u[:, :, c] - w[:, :, c] @ state  # [B, H, C, Dv]
        out[:, :, c] = q_decayed[:, :, c] @ state + intra[:, :, c] @ v_new
        state = state * chunk_decay[:, :, c] + k_decayed[:, :, c].transpose(-1, -2) @ v_new

    out = out.reshape(b, h, -1, dv)[:, :, :t]
    return out.transpose(1, 2).to(out_dtype, memory_format=torch.contiguous_format), state


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    use_qk_l2norm: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated delta rule one token at a time (decode: T = 1, a batch of sequences); returns (output, state)."""
    out_dtype = q.dtype
    b, t = q.shape[:2]
    q, k, v, g, beta = _heads_first_fp32(q, k, v, g, beta, use_qk_l2norm)  # [B, H, T, *]
    h, dk, dv = q.shape[1], q.shape[-1], v.shape[-1]
    q = q / dk**0.5  # (HF's recurrent form divides; the chunked one multiplies by dk**-0.5)

    state = _initial_state(initial_state, b, h, dk, dv, q)  # [B, H, Dk, Dv]
    out = torch.zeros_like(v)
    for i in range(t):
        q_t, k_t, v_t = q[:, :, i], k[:, :, i], v[:, :, i]  # [B, H, Dk|Dv]
        state = state * g[:, :, i].exp()[..., None, None]
        predicted = (state * k_t.unsqueeze(-1)).sum(dim=-2)  # S^T k: [B, H, Dv]
        delta = (v_t - predicted) * beta[:, :, i].unsqueeze(-1)
        state = state + k_t.unsqueeze(-1) * delta.unsqueeze(-2)
        out[:, :, i] = (state * q_t.unsqueeze(-1)).sum(dim=-2)
    return out.transpose(1, 2).contiguous().to(out_dtype), state
