"""Copy KV blocks between two caches in one kernel launch: dst[dst_ids[i]] = src[src_ids[i]].

For cuda_ipc, whose fetcher maps the exporter's KV into its own address space: the source rows live on
the peer GPU and are read over NVLink (or PCIe P2P) by this GPU's SMs. One launch moves any pattern of
block ids (scattered on either side or both) with no staging buffer and no per-run cudaMemcpy: the
grid is (block pairs, spans of a block), every program moves STEPS tiles of TILE words, so a transfer
keeps thousands of wide loads and stores in flight, which is what a long NVLink round trip needs.

Rows are viewed as int64 (or int32) words by the caller (`cuda_ipc.wide`); the kernel copies words
bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

TILE = 4096  # words per program and step (32 KiB of int64)
NUM_WARPS = 8
STEPS = 4  # tiles per program: fewer, longer-lived programs keep more stores in flight


@triton.jit
def _copy_rows(src, dst, src_ids, dst_ids, row_words, TILE: tl.constexpr, STEPS: tl.constexpr):
    pair = tl.program_id(0)
    first = tl.program_id(1) * TILE * STEPS
    s = tl.load(src_ids + pair).to(tl.int64)
    d = tl.load(dst_ids + pair).to(tl.int64)
    for step in tl.static_range(STEPS):
        offs = first + step * TILE + tl.arange(0, TILE)
        mask = offs < row_words
        words = tl.load(src + s * row_words + offs, mask=mask)
        tl.store(dst + d * row_words + offs, words, mask=mask)


def copy_rows(src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor) -> None:
    """dst[dst_ids] = src[src_ids] for 2-D word views of equal row length, enqueued on the current
    stream of dst's device. `src` may be a peer GPU's memory mapped on this device (cuda_ipc p2p)."""
    if src.dim() != 2 or dst.dim() != 2 or src.shape[1] != dst.shape[1] or src.dtype != dst.dtype:
        raise ValueError(f"rows must be 2-D of one width and dtype: {tuple(src.shape)}, {tuple(dst.shape)}")
    if src_ids.numel() != dst_ids.numel():
        raise ValueError(f"{src_ids.numel()} source ids, {dst_ids.numel()} destination ids")
    n, width = src_ids.numel(), src.shape[1]
    if n == 0:
        return
    grid = (n, triton.cdiv(width, TILE * STEPS))
    _copy_rows[grid](src, dst, src_ids, dst_ids, width, TILE=TILE, STEPS=STEPS, num_warps=NUM_WARPS)


__all__ = ["NUM_WARPS", "STEPS", "TILE", "copy_rows"]
