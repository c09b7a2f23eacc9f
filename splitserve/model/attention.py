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

from splitserve.kernels.cpu import attention as cpu_attention
from splitserve.kernels.cpu import prefill as cpu_prefill


@dataclass(frozen=True)
class PrefillChunk:
    query_start: int  # offset of the chunk's first token in the flat batch
    query_len: int
    context_len: int  # tokens in the cache after this chunk is stored (prefix + chunk)
    block_table: torch.Tensor | None  # [num_blocks_for_context] int64 (None: backend reads PrefillBatch)


@dataclass(frozen=True)
class PrefillBatch:
    """All prefill chunks of a step as device tensors, for backends that take them in one launch."""

    query_start: torch.Tensor  # [P] int64
    query_len: torch.Tensor  # [P] int64
    context_len: torch.Tensor  # [P] int64
    block_tables: torch.Tensor  # [P, max_blocks] int64, padded with 0
    max_query_len: int


@dataclass(frozen=True)
class DecodeGroup:
    """Decode rows [start, end) of similar context length, padded to the longest of them."""

    start: int
    end: int
    block_tables: torch.Tensor  # [end - start, max_blocks] int64, padded with 0
    context_lens: torch.Tensor  # [end - start] int64
    num_splits: int = 1  # split-K factor for backends that split the context (fixed per CUDA graph)
    # the most tokens at the end of a row's context that the step itself stores (1: the row's own; a
    # verify chunk's rows: the chunk's): the Triton decode kernel reads those after its PDL wait
    fresh: int = 1


@dataclass(frozen=True)
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] int64: block_id * block_size + offset for every token
    num_decode_tokens: int
    decode_groups: tuple[DecodeGroup, ...]  # decode rows sorted by context length, in groups
    prefills: tuple[PrefillChunk, ...]
    seq_slots: torch.Tensor | None = None  # [num_decode + num_prefill] state slots (hybrid models)
    prefill_batch: PrefillBatch | None = None  # set for backends with `batched_prefill`
    # The decode rows are `decode_steps` equal runs, the j-th run holding position j of the same
    # sequences in the same order (a hybrid verify step laid out as decode rows, verify_graphs.py): the
    # linear-attention layers advance their states one run after another. 1: every row its own sequence.
    decode_steps: int = 1

    def decode_spans(self) -> list[slice]:
        """The decode rows' runs, in the order their states advance (one span when decode_steps is 1)."""
        n, s = self.num_decode_tokens, self.decode_steps
        assert n % s == 0, "decode rows are not whole runs of the sequences"
        return [slice(j * (n // s), (j + 1) * (n // s)) for j in range(s)]

    def sole_decode_group(self, rows: int) -> DecodeGroup | None:
        """The one decode group when all `rows` of the step decode in one group (no prefill), else None."""
        groups = self.decode_groups
        if self.prefills or len(groups) != 1 or groups[0].end - groups[0].start != rows:
            return None
        return groups[0]


class AttentionBackend(Protocol):
    #: True: the backend reads `meta.prefill_batch` (one launch for all chunks), not per-chunk tables
    batched_prefill: bool

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
    """Gather-then-SDPA attention: one call per group of decode rows, one per prefill chunk.

    On CPU (`fold_gqa`), grouped-query heads are folded into the query dimension for decode (the G
    query heads of a KV head act as G queries of one sequence), so K/V are never repeated, and
    prefill repeats K/V to 4-D, which is PyTorch's fast CPU path (about 4x faster than
    `enable_gqa` there). On CUDA, where this path is bound by kernel launches, SDPA's own
    `enable_gqa` does both with fewer kernels.

    On CPU (`fold_gqa`), decode rows go to `cpu_attention.paged_decode` when that op could be built: it
    reads the blocks in place instead of gathering them (`_decode` stays as the reference and fallback).
    A prefill chunk with no earlier context attends over its own K/V as computed, without a gather.
    """

    batched_prefill = False

    def __init__(self, scale: float, fold_gqa: bool = True) -> None:
        self.scale = scale
        self.fold_gqa = fold_gqa
        self.cpu_kernel = fold_gqa and cpu_attention.start()  # used once `cpu_attention.ready()`
        self.prefill_kernel = fold_gqa and cpu_prefill.start()  # AVX-512 hosts, once `ready()`

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, D]
        meta: AttentionMetadata,
        stored: bool = False,  # k and v are in the cache already (kernels/cpu/fused.py's rope_store)
    ) -> torch.Tensor:
        k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]  # [num_blocks, block_size, KVH, D]
        if not stored:
            store_kv(k_cache, v_cache, k, v, meta.slot_mapping)
        kernel = self.reads_in_place(kv) and q.dtype == kv.dtype
        g = meta.sole_decode_group(len(q)) if kernel else None
        if g is not None:  # a decode-only step: the op's output is the answer, no copy into `out`
            return cpu_attention.paged_decode(
                q, k_cache, v_cache, g.block_tables, g.context_lens, self.scale
            ).flatten(1)
        out = torch.empty_like(q)
        for group in meta.decode_groups:
            rows = slice(group.start, group.end)
            if kernel:
                out[rows] = cpu_attention.paged_decode(
                    q[rows], k_cache, v_cache, group.block_tables, group.context_lens, self.scale
                )
            else:
                out[rows] = self._decode(q[rows], k_cache, v_cache, group)
        prefill_kernel = self.prefill_kernel and cpu_prefill.ready() and q.device.type == "cpu"
        prefill_kernel = prefill_kernel and q.dtype == kv.dtype == torch.float32
        prefill_kernel = prefill_kernel and cpu_prefill.fits(q, k_cache)
        for chunk in meta.prefills:
            rows = slice(chunk.query_start, chunk.query_start + chunk.query_len)
            if prefill_kernel and chunk.block_table is not None:  # K/V read from the cache in place
                out[rows] = cpu_prefill.prefill_attention(
                    q[rows], k_cache, v_cache, chunk.block_table, chunk.context_len, self.scale
                )
            elif self.fold_gqa and chunk.context_len == chunk.query_len and k.dtype == kv.dtype:  # no gather
                out[rows] = self._attend_fresh(q[rows], k[rows], v[rows])
            else:
                out[rows] = self._prefill(q[rows], k_cache, v_cache, chunk)
        return out.flatten(1)  # [T, H * D]

    def reads_in_place(self, kv: torch.Tensor) -> bool:
        """Whether decode rows over this fp32 CPU cache go to kernels/cpu/attention.py's op (loaded, not
        switched off), which reads each sequence's blocks in place, instead of the gather."""
        fp32_cpu = kv.device.type == "cpu" and kv.dtype == torch.float32
        return self.cpu_kernel and fp32_cpu and cpu_attention.ready()

    def _decode(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, group: DecodeGroup
    ) -> torch.Tensor:
        b, h, d = q.shape
        keys = _gather(k_cache, group.block_tables)  # [B, KVH, L, D]
        values = _gather(v_cache, group.block_tables)
        kvh = keys.shape[1]
        positions = torch.arange(keys.shape[2], device=q.device)
        mask = positions[None, :] < group.context_lens[:, None]  # [B, L]
        if self.fold_gqa:
            qg = q.view(b, kvh, h // kvh, d)  # [B, KVH, G, D]: head h reads KV head h // G
            out = F.scaled_dot_product_attention(
                qg, keys, values, attn_mask=mask[:, None, None, :], scale=self.scale
            )
        else:
            out = F.scaled_dot_product_attention(
                q.unsqueeze(2),
                keys,
                values,
                attn_mask=mask[:, None, None, :],
                scale=self.scale,
                enable_gqa=True,
            )  # [B, H, 1, D]
        return out.reshape(b, h, d)

    def _attend_fresh(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Causal attention of a whole prompt over its own K/V (the values just stored), CPU layout."""
        h, kvh = q.shape[1], k.shape[1]
        g = h // kvh
        keys = k.transpose(0, 1).repeat_interleave(g, dim=0)  # [H, q_len, D]
        values = v.transpose(0, 1).repeat_interleave(g, dim=0)
        out = F.scaled_dot_product_attention(
            q.transpose(0, 1)[None], keys[None], values[None], is_causal=True, scale=self.scale
        )[0]
        return out.transpose(0, 1)

    def _prefill(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, chunk: PrefillChunk
    ) -> torch.Tensor:
        ctx, h = chunk.context_len, q.shape[1]
        assert chunk.block_table is not None
        keys = _gather(k_cache, chunk.block_table[None])[0, :, :ctx]  # [KVH, ctx, D]
        values = _gather(v_cache, chunk.block_table[None])[0, :, :ctx]
        qh = q.transpose(0, 1)  # [H, q_len, D]
        mask = None
        if ctx != chunk.query_len:  # a later chunk: it also sees the earlier part of the prompt
            rows = torch.arange(chunk.query_len, device=q.device)[:, None] + (ctx - chunk.query_len)
            mask = torch.arange(ctx, device=q.device)[None, :] <= rows  # [q_len, ctx]
        if self.fold_gqa:  # CPU: 4-D with K/V repeated per query head
            g = h // keys.shape[0]
            out = F.scaled_dot_product_attention(
                qh[None],
                keys.repeat_interleave(g, dim=0)[None],
                values.repeat_interleave(g, dim=0)[None],
                attn_mask=mask,
                is_causal=mask is None,
                scale=self.scale,
            )[0]
        else:
            out = F.scaled_dot_product_attention(
                qh, keys, values, attn_mask=mask, is_causal=mask is None, scale=self.scale, enable_gqa=True
            )
        return out.transpose(0, 1)  # [q_len, H, D]


class TritonPagedAttention:
    """CUDA: the Triton kernels of `splitserve.kernels.paged_attention`: one launch for all decode
    rows (split-K when there are few of them) and one for all prefill chunks; no K/V gathers."""

    batched_prefill = True

    def __init__(self, scale: float) -> None:
        from splitserve.kernels import paged_attention

        self.scale = scale
        self._kernels = paged_attention

    def forward(
        self,
        layer: int,
        q: torch.Tensor,  # [T, H, D]
        k: torch.Tensor,  # [T, KVH, D]
        v: torch.Tensor,  # [T, KVH, D]
        kv: torch.Tensor,  # [num_blocks, L, 2, block_size, KVH, D]
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        store_kv(kv[:, layer, 0], kv[:, layer, 1], k, v, meta.slot_mapping)
        return self.attend(layer, q, kv, meta)

    def attend(self, layer: int, q: torch.Tensor, kv: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """Attention over a cache that already holds this step's K/V (stored by a fused kernel)."""
        k_cache, v_cache = kv[:, layer, 0], kv[:, layer, 1]
        q = q.contiguous()
        out = torch.empty_like(q)
        for g in meta.decode_groups:
            self._kernels.paged_decode_attention(
                q[g.start : g.end], k_cache, v_cache, g.block_tables, g.context_lens, self.scale,
                g.num_splits, out=out[g.start : g.end], fresh=g.fresh,
            )  # fmt: skip
        batch = meta.prefill_batch
        fresh = _sole_fresh_chunk(meta)
        if fresh is not None:
            assert batch is not None
            _attend_fresh_chunk(q, k_cache, v_cache, batch.block_tables[0], fresh, self.scale, out)
        elif batch is not None:
            self._kernels.paged_prefill_attention(
                q, k_cache, v_cache, out, batch.block_tables, batch.query_start, batch.query_len,
                batch.context_len, batch.max_query_len, self.scale,
            )  # fmt: skip
        return out.flatten(1)


FRESH_SDPA_MIN = 512  # a lone prefill chunk with no earlier context from this length goes to torch's SDPA


def _sole_fresh_chunk(meta: AttentionMetadata) -> PrefillChunk | None:
    """The step's one prefill chunk when it has no earlier context and at least FRESH_SDPA_MIN tokens:
    a long prompt's first chunk, where torch's fused causal attention (flash attention on CUDA) beats
    the paged kernel by ~1.7x at 4,096 tokens (bench/prefill_attention_gpu.py). Never while a CUDA graph
    is captured: a graph replays for chunks with cached context too."""
    if meta.prefill_batch is None or len(meta.prefills) != 1:
        return None
    chunk = meta.prefills[0]
    if chunk.context_len != chunk.query_len or chunk.query_len < FRESH_SDPA_MIN:
        return None
    capturing = torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()
    return None if capturing else chunk


def _attend_fresh_chunk(
    q: torch.Tensor,  # [T, H, D], the step's rows
    k_cache: torch.Tensor,  # [num_blocks, block_size, KVH, D]
    v_cache: torch.Tensor,
    table: torch.Tensor,  # the chunk's block table
    chunk: PrefillChunk,
    scale: float,
    out: torch.Tensor,  # [T, H, D]: the chunk's rows written
) -> None:
    """Causal attention of a fresh chunk over its own K/V, read back from its blocks (just stored)."""
    n, bs = chunk.query_len, k_cache.shape[1]
    blocks = table[: -(-n // bs)]
    k = k_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)  # [KVH, n, D]
    v = v_cache[blocks].flatten(0, 1)[:n].transpose(0, 1)
    rows = slice(chunk.query_start, chunk.query_start + n)
    # 4-D, as the fused (flash) kernels require
    o = F.scaled_dot_product_attention(
        q[rows].transpose(0, 1)[None], k[None], v[None], is_causal=True, scale=scale, enable_gqa=True
    )  # [1, H, n, D]
    out[rows] = o[0].transpose(0, 1)


def triton_supported(device: torch.device, head_dim: int) -> bool:
    """Whether the Triton backend can run here: CUDA, triton importable, a power-of-two head_dim >= 16."""
    if device.type != "cuda" or head_dim < 16 or head_dim & (head_dim - 1):
        return False
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def store_kv(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor
) -> None:
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = k
    v_cache[blocks, offsets] = v


def _gather(cache: torch.Tensor, tables: torch.Tensor) -> torch.Tensor:
    # cache [num_blocks, block_size, KVH, D]; tables [B, nb] -> [B, KVH, nb * block_size, D]
    # NOTE: index_select copies whole blocks (rows of dim 0); advanced indexing `cache[tables]` copies the
    # same values element by element, about 3x slower on CPU (bench/cpu_engine.py's batch 32)
    b, nb = tables.shape
    g = cache.index_select(0, tables.reshape(-1))  # [B * nb, block_size, KVH, D]
    return g.view(b, nb * cache.shape[1], cache.shape[2], cache.shape[3]).transpose(1, 2)
