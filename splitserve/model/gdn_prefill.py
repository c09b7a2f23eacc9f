"""Varlen prefill for the Gated DeltaNet layers: every prefill chunk of a step in one conv launch and one
`chunk_gated_delta_rule` call per layer (CUDA, through flash-linear-attention's `fla-core`).

A step's prefill chunks lie back to back after its decode rows. `build_linear_prefill` turns
`AttentionMetadata` into device tensors once per step (not per layer); each layer then

1. runs the causal conv + SiLU over all chunks (splitserve/kernels/causal_conv_varlen.py), reading
   each chunk's conv window from its slot, and writes the windows back; its output goes straight
   into contiguous q, k and v (fla's kernels read them so: no strided copies in between), q and k
   L2-normalized per head in the same launch where the head dim allows (`can_fuse_qk_l2norm`);
2. gathers the chunks' recurrent states from their slots ([P, Hv, Dk, Dv] fp32), runs one varlen
   gated delta rule with the q/k L2 norm (unless the conv did it), the sigmoid of beta and the decay
   gate `-exp(A_log) * softplus(a + dt_bias)` fused in the kernels, and scatters the final states back.

`linear_attention_backend` (EngineConfig): "torch" keeps the per-chunk torch rule (the CPU path and
the reference), "fla" needs CUDA and an importable `fla`, "auto" picks fla when both hold.
`VARLEN_RULE` can be replaced by a function of fla's signature (the CPU tests use a torch one).

fla's public `chunk_gated_delta_rule` goes through its backend dispatch, argument checks, an autograd
Function and a contiguity guard on every call: host work paid 24 times a step (1.37 ms a call in a
64-token step on the H200, where the whole step's GPU time is 12 ms). `fla_forward` calls the same
forward kernels directly (l2norm, beta sigmoid, `chunk_gated_delta_rule_fwd`), with the step's chunk
table built once; SPLITSERVE_FLA_DIRECT=0 goes back through the public call (to compare), and
SPLITSERVE_CONV_QK_NORM=0 leaves the q/k L2 norm to fla (to compare).
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.model.attention import AttentionMetadata

BACKENDS = ("auto", "torch", "fla")
CHUNK = 64  # the gated delta rule's chunk length in fla
# whether the varlen conv L2-normalizes q and k where it can (read once: captured graphs and their
# replays must take the same path)
CONV_QK_NORM = os.environ.get("SPLITSERVE_CONV_QK_NORM", "1") != "0"


@dataclass(frozen=True)
class LinearPrefill:
    """All prefill chunks of one step, for the varlen linear-attention path (built once per step)."""

    row0: int  # first prefill row of the flat batch (= number of decode rows)
    num_rows: int
    cu_seqlens: torch.Tensor  # [P + 1] int64 on the device: chunk starts relative to row0, then num_rows
    cu_seqlens_cpu: torch.Tensor  # [P + 1] int64, the same on the host
    token_seq: torch.Tensor  # [num_rows] int32 on the device: each row's chunk index
    slots: torch.Tensor  # [P] int64 on the device: each chunk's state slot
    chunk_indices: torch.Tensor | None  # [num_chunks, 2] fla's (chunk, block) table, or None


@functools.cache
def fla_rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """fla's `chunk_gated_delta_rule`, or None when fla-core (or triton) is not importable."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except ImportError:
        return None
    return chunk_gated_delta_rule


@functools.cache
def fla_forward() -> Callable[..., tuple[torch.Tensor, torch.Tensor]] | None:
    """fla's forward kernels of `chunk_gated_delta_rule` (q/k l2 norm, sigmoid beta and the gate fused),
    called without its dispatch, checks and autograd Function; same signature. None without fla."""
    if fla_rule() is None or os.environ.get("SPLITSERVE_FLA_DIRECT", "1") == "0":
        return None
    try:
        from fla.modules.norm.l2norm import l2norm_fwd
        from fla.ops.common.gate import fused_beta_sigmoid_fwd
        from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd
    except ImportError:  # another fla layout: the public call
        return None

    def forward(  # noqa: ANN202
        q, k, v, a, b, *, initial_state, A_log, dt_bias, cu_seqlens, chunk_indices,  # noqa: ANN001
        use_qk_l2norm_in_kernel: bool = False, **_: object,
    ):  # fmt: skip
        dtype = q.dtype
        q, k, v, a, b = (x.contiguous() for x in (q, k, v, a, b))  # slices of the projections' outputs
        if use_qk_l2norm_in_kernel:
            q, _ = l2norm_fwd(q)
            k, _ = l2norm_fwd(k)
        beta = fused_beta_sigmoid_fwd(b, 1.0)
        _, o, _, final, _, _ = chunk_gated_delta_rule_fwd(
            q=q, k=k, v=v, g=a, beta=beta, scale=k.shape[-1] ** -0.5, initial_state=initial_state,
            output_final_state=True, cu_seqlens=cu_seqlens, chunk_indices=chunk_indices,
            use_gate_in_kernel=True, A_log=A_log, dt_bias=dt_bias, chunk_size=CHUNK,
        )  # fmt: skip
        return o.to(dtype), final

    return forward


def resolve_backend(choice: str, device: torch.device) -> str:
    """ "torch" or "fla" for the EngineConfig choice on `device`; ValueError for an impossible one."""
    if choice not in BACKENDS:
        raise ValueError(f"linear_attention_backend must be one of {', '.join(BACKENDS)}, not {choice!r}")
    usable = device.type == "cuda" and fla_rule() is not None
    if choice == "fla" and not usable and VARLEN_RULE is None:
        raise ValueError(
            "linear_attention_backend=fla needs CUDA and fla-core (pip install --no-deps fla-core einops)"
        )
    if choice == "auto":
        return "fla" if usable else "torch"
    return choice


# A replacement for fla's rule (same signature), e.g. a torch one for CPU tests; None: fla's.
VARLEN_RULE: Callable[..., tuple[torch.Tensor, torch.Tensor]] | None = None


def _rule() -> Callable[..., tuple[torch.Tensor, torch.Tensor]]:
    rule = VARLEN_RULE or fla_forward() or fla_rule()
    assert rule is not None, "varlen linear attention without fla"
    return rule


def build_linear_prefill(meta: AttentionMetadata, device: torch.device) -> LinearPrefill | None:
    """The step's prefill chunks as device tensors (one pinned host-to-device copy, fla's chunk table
    included); None without prefills."""
    if not meta.prefills:
        return None
    assert meta.seq_slots is not None
    row0 = meta.num_decode_tokens
    lens = np.array([p.query_len for p in meta.prefills], dtype=np.int64)
    cu = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=cu[1:])
    seq = np.repeat(np.arange(len(lens), dtype=np.int64), lens)
    with_table = VARLEN_RULE is None and fla_rule() is not None
    table = chunk_table(lens) if with_table else np.empty((0, 2), dtype=np.int64)
    packed = torch.from_numpy(np.concatenate([cu, seq, table.ravel()]))
    if device.type == "cuda":
        packed = packed.pin_memory().to(device, non_blocking=True)
    n_cu, n_seq = len(cu), len(seq)
    cu_dev, seq_dev = packed[:n_cu], packed[n_cu : n_cu + n_seq].to(torch.int32)
    chunk_indices = packed[n_cu + n_seq :].view(-1, 2) if with_table else None
    slots = meta.seq_slots[row0 : row0 + len(lens)]
    return LinearPrefill(row0, int(cu[-1]), cu_dev, torch.from_numpy(cu), seq_dev, slots, chunk_indices)


def chunk_table(lens: np.ndarray) -> np.ndarray:
    """fla's chunk table of sequences of `lens` tokens ([num_chunks, 2] int64: each CHUNK-row chunk's
    sequence and its index in it), what `fla.ops.utils.index.prepare_chunk_indices` computes with
    torch ops on the host and then copies from pageable memory; here it rides the step's pinned copy."""
    counts = (lens + CHUNK - 1) // CHUNK
    seq = np.repeat(np.arange(len(lens), dtype=np.int64), counts)
    starts = np.cumsum(counts) - counts
    return np.stack([seq, np.arange(len(seq), dtype=np.int64) - starts[seq]], axis=1)


def varlen_conv(
    lp: LinearPrefill,
    mixed: torch.Tensor,
    conv_states: torch.Tensor,
    weight: torch.Tensor,
    key_dim: int,
    head_dim: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, bool]:
    """silu(conv) of mixed's prefill rows, continuing and then updating the windows; -> q, k [Tp,
    key_dim] and v [Tp, C - 2 key_dim], each contiguous (the channels' q | k | v split), and whether
    q and k came out L2-normalized per key head of `head_dim` (then the rule must not normalize
    them again: `varlen_rule`'s qk_normed). The choice depends on the shapes only."""
    from splitserve.kernels import causal_conv_varlen as ccv

    x = mixed[lp.row0 : lp.row0 + lp.num_rows]  # [Tp, C]
    normed = CONV_QK_NORM and ccv.can_fuse_qk_l2norm(key_dim, head_dim)
    q, k, v = ccv.causal_conv1d_varlen_split(
        x, conv_states, weight, lp.cu_seqlens, lp.token_seq, lp.slots, key_dim,
        qk_norm_dim=head_dim if normed else None,
    )  # fmt: skip
    ccv.conv1d_varlen_update_states(x, conv_states, lp.cu_seqlens, lp.slots)
    return q, k, v, normed


def rule_kwargs(
    lp: LinearPrefill,
    initial_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    qk_normed: bool = False,
) -> dict:
    """fla's varlen keyword arguments for the chunks of `lp`: the decay gate, the q/k l2 norm (unless
    `qk_normed`: q and k come normalized) and sigmoid(beta) fused in its kernels, the chunks' states
    in and out."""
    return dict(
        initial_state=initial_state,
        output_final_state=True,
        use_qk_l2norm_in_kernel=not qk_normed,
        use_beta_sigmoid_in_kernel=True,
        use_gate_in_kernel=True,
        A_log=A_log,
        dt_bias=dt_bias,
        cu_seqlens=lp.cu_seqlens,
        cu_seqlens_cpu=lp.cu_seqlens_cpu,
        chunk_indices=lp.chunk_indices,
    )


def varlen_rule(
    lp: LinearPrefill,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    rec_states: torch.Tensor,
    qk_normed: bool = False,
) -> torch.Tensor:
    """The gated delta rule over every prefill chunk, from and back into the chunks' recurrent states
    (rec_states [num_slots, Hv, Dk, Dv] fp32, in place); -> o [Tp, Hv, Dv].

    q, k [Tp, Hk, Dk]; v [Tp, Hv, Dv] (the prefill rows only, contiguous: `varlen_conv`'s); a, b
    [T, Hv] raw, all rows of the step (the decay gate and sigmoid(beta) are fused). `qk_normed`: q and
    k are L2-normalized already (`varlen_conv` said so), else the rule normalizes them."""
    rows = slice(lp.row0, lp.row0 + lp.num_rows)
    initial = rec_states[lp.slots]  # [P, Hv, Dk, Dv] fp32
    o, final = _rule()(
        q[None], k[None], v[None], a[None, rows], b[None, rows],
        **rule_kwargs(lp, initial, A_log, dt_bias, qk_normed),
    )  # fmt: skip
    rec_states[lp.slots] = final.to(rec_states.dtype)
    return o[0]


def torch_varlen_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    *,
    initial_state: torch.Tensor,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    cu_seqlens_cpu: torch.Tensor,
    use_qk_l2norm_in_kernel: bool = False,
    **_: object,
) -> tuple[torch.Tensor, torch.Tensor]:
    """fla's varlen call (gates, l2 norm and sigmoid fused) computed with the torch chunked rule, one
    chunk at a time: a stand-in for `VARLEN_RULE` where fla cannot run (the CPU tests). q and k are
    L2-normalized here only with use_qk_l2norm_in_kernel, as fla does."""
    import torch.nn.functional as F

    from splitserve.model.gated_delta import chunk_gated_delta_rule

    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)  # [1, T, Hv]
    beta = b.sigmoid()
    out = torch.empty_like(v)  # [1, T, Hv, Dv]
    finals = []
    bounds = cu_seqlens_cpu.tolist()
    for i, (s, e) in enumerate(zip(bounds[:-1], bounds[1:], strict=True)):
        o, state = chunk_gated_delta_rule(
            q[:, s:e], k[:, s:e], v[:, s:e], g[:, s:e], beta[:, s:e], initial_state[i : i + 1],
            use_qk_l2norm=use_qk_l2norm_in_kernel,
        )  # fmt: skip
        out[:, s:e] = o
        finals.append(state)
    return out, torch.cat(finals)
