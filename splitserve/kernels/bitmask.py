"""A grammar's token bitmask applied to logits in one launch: logits[r, t] = -inf where bit t of
bitmask[r] is 0 (xgrammar's layout: [rows, ceil(V/32)] int32, bit t % 32 of word t // 32).

Replaces the unpack in torch (shift, and, compare, reshape, masked_fill: several kernels and a
[rows, V] bool temporary) with one pass that reads each word once and writes only the banned logits.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 4096  # tokens per program (128 words)


@triton.jit
def _apply_bitmask(logits, bitmask, vocab, logits_stride, words, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    start = tl.program_id(1) * BLOCK
    w = start // 32 + tl.arange(0, BLOCK // 32)
    packed = tl.load(bitmask + row * words + w, mask=w < words, other=-1)
    banned = ((packed[:, None] >> tl.arange(0, 32)[None, :]) & 1) == 0
    banned = tl.reshape(banned, (BLOCK,))
    offs = start + tl.arange(0, BLOCK)
    tl.store(logits + row * logits_stride + offs, float("-inf"), mask=banned & (offs < vocab))


def apply_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """In place: `logits` [N, V] (unit stride along V) at -inf where `bitmask` [N, W >= ceil(V/32)]
    int32, on the same device, has a 0 bit. -> logits."""
    n, vocab = logits.shape
    if bitmask.dtype != torch.int32 or bitmask.dim() != 2 or bitmask.shape[0] != n:
        raise ValueError(f"bitmask must be [{n}, W] int32, not {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask.shape[1] * 32 < vocab or logits.stride(1) != 1 or bitmask.stride(1) != 1:
        raise ValueError("the bitmask must cover the vocabulary, and both rows must be contiguous")
    if n == 0:
        return logits
    grid = (n, triton.cdiv(vocab, BLOCK))
    _apply_bitmask[grid](
        logits, bitmask, vocab, logits.stride(0), bitmask.stride(0), BLOCK=BLOCK, num_warps=4
    )
    return logits


__all__ = ["apply_bitmask_"]
