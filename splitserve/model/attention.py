"""Paged attention behind a small backend interface.

The KV cache is one tensor, block-major so that one request's blocks are contiguous runs of bytes
(what a KV transport wants to move):

    kv[num_blocks, num_layers, 2, block_size, num_kv_heads, head_dim]

A flat batch of T tokens arrives ordered as: all decode tokens first (one per decoding sequence),
then each prefill chunk. `AttentionMetadata` says where each token's K/V goes (`slot_mapping`) and
which blocks each sequence reads. Backends implement `forward(layer, q, k, v, kv, meta)`; this file
has the plain-torch one, used on CPU and as the reference for the GPU kernels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the flat batch
    query_len: int
    context_len: int  # tokens in the cache after this chunk is stored (prefix + chunk)
    block_table: torch.Tensor  # [num_blocks_for_context] int64


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for every token
    num_decode_tokens: int
    decode_block_tables: torch.Tensor  # [num_decode, max_blocks] int64, padded with 0
    decode_context_lens: torch.Tensor  # [num_decode] int64
    prefills: tuple[PrefillChunk, ...]
    seq_slots: torch.Tensor | None = None  # [num_decode + num_prefill] state slots (hybrid models)


class AttentionBackend(Protocol):
    def forward(
        self,
        layer: int,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor: ...


class TorchPagedAttention:
    """Gather-then-SDPA attention: batched for decode tokens, one call per prefill chunk."""

    def __init__(self, scale: float) -> None:
        self.scale = scale

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]  # [num_blocks, block_size, KVH, D]
        store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        out = torch.empty_like(q)
        n = meta.num_decode_tokens
        if n:
            out[:n] = self._decode(q[:n], k_cache, v_cache, meta)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            out[rows] = self._prefill(q[rows], k_cache, v_cache, chunk)
        return out.flatten(1)  # [T, H * D]

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        tables = meta.decode_block_tables
        keys = _gather(k_cache, tables)  # [B, KVH, L, D]
        values = _gather(v_cache, tables)
        positions = torch.arange(keys.shape[2], device=q.device)
        mask = positions[None, :] < meta.decode_context_lens[:, None]  # [B, L]
        out = F.scaled_dot_product_attention(
            q.unsqueeze(2),  # [B, H, 1, D]
            keys,
            values,
            attn_mask=mask[:, None, None, :],
            scale=self.scale,
            enable_gqa=True,
        )
        return out.squeeze(2)  # [B, H, D]

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk
    ) -> torch.Tensor:
        ctx = chunk.context_len
        keys = _gather(k_cache, chunk.block_table[None])[0, :, :ctx]  # [KVH, ctx, D]
        values = _gather(v_cache, chunk.block_table[None])[0, :, :ctx]
        qh = q.transpose(0, 1)  # [H, q_len, D]
        if ctx == chunk.query_len:
            out = F.scaled_dot_product_attention(
                qh, keys, values, is_causal=True, scale=self.scale, enable_gqa=True
            )
        else:
            start = ctx - chunk.query_len
            rows = torch.arange(chunk.query_len, device=q.device)[:, None] + start
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows  # [q_len, ctx]
            out = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
            )
        return out.transpose(0, 1)  # [q_len, H, D]


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    # cache [num_blocks, block_size, KVH, D]; tables [B, nb] -> [B, KVH, nb * block_size, D]
    b, nb = tables.shape
    g = cache[tables]  # [B, nb, block_size, KVH, D]
    return g.reshape(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
