"""CUDA graphs for short prefill steps of hybrid models (one prefill chunk, no decodes).

A short prefill step is bound by the host, not the GPU: on the H200 a 64-token step of Qwen3.5-9B
runs ~11.5 ms of kernels but takes ~65 ms, spent launching ~530 Triton kernels (fla's gated delta
rule and ours) and the torch ops around them, 32 layers deep. That is what a prefix-cache hit
computes (the prompt's tail after a cached system prompt), so the hit was no faster than a miss.
This module captures the whole forward pass plus the LM head of such a step for a ladder of chunk
lengths (`SIZES`, up to `SPLITSERVE_PREFILL_GRAPHS` tokens, default 256; 0 turns them off), as the
decode graphs (runner.py) do for decode steps, and replays the smallest that holds the chunk.

Padding. A captured graph has fixed shapes and launch grids, so a chunk of L <= B tokens runs as
Tp = B + 64 rows in three sequences of fla's varlen layout: the chunk itself, then two padding
sequences that write their recurrent and conv state into the scratch state slot (and their K/V into
the scratch block) that no request owns. Their lengths make the number of 64-token chunks fla walks
(its launch grids) Tp / 64 + 1 whatever L is: (64 - L % 64, the rest) when L % 64 != 0, else
(32, the rest). The full-attention layers see one prefill of L queries (the grid is sized for B; rows
past L are masked), against the chunk's block table padded with the scratch block. So the real
sequence's tokens, KV and state are computed exactly as an eager step computes them, and the padded
rows touch nothing a request reads.

Every input reaches the GPU in two copies (one packed int64 buffer, and the block table). fla keeps a
small identity-keyed cache of derived index tensors (`tensor_cache`); it is turned off during warm-up
and capture so that the graph recomputes them from the static buffers on every replay.
"""

from __future__ import annotations

import logging
import os
import time
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from splitserve.model.attention import AttentionMetadata, PrefillBatch
from splitserve.model.decoder import ForwardContext
from splitserve.model.gdn_prefill import CHUNK, LinearPrefill

if TYPE_CHECKING:
    from splitserve.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

ENV = "SPLITSERVE_PREFILL_GRAPHS"  # the longest chunk captured (tokens); 0: no prefill graphs
DEFAULT_MAX = 256
SIZES = (64, 128, 256, 512, 1024, 2048)
NSEQ = 3  # the chunk and two padding sequences


def prefill_graph_sizes(max_tokens: int) -> list[int]:
    """The captured chunk lengths up to `max_tokens` (multiples of fla's 64-token chunk)."""
    return [b for b in SIZES if b <= max_tokens]


def env_max_tokens() -> int:
    return int(os.environ.get(ENV, str(DEFAULT_MAX)))


def padding(length: int, rows: int) -> tuple[int, int]:
    """The two padding sequences' lengths for a chunk of `length` tokens in `rows` captured rows."""
    r = length % CHUNK
    a = CHUNK - r if r else CHUNK // 2
    return a, rows - length - a


def chunk_table(lens: list[int]) -> np.ndarray:
    """fla's (sequence, chunk) table of a varlen batch: [num_chunks, 2] int64."""
    pairs = [(i, j) for i, n in enumerate(lens) for j in range(-(-n // CHUNK))]
    return np.asarray(pairs, dtype=np.int64)


class PrefillGraphs:
    """CUDA graphs of a one-chunk prefill step (forward + the LM head row), per chunk-length bucket."""

    def __init__(
        self,
        runner: Any,  # the engine's ModelRunner (its model, attention backend, KV, states, device)
        sizes: list[int],
        max_model_len: int,
        scratch_block: int,
        scratch_slot: int,
        pool: object = None,
    ) -> None:
        self.runner = runner
        self.sizes = sizes
        self.max_tokens = sizes[-1]
        self.scratch_block, self.scratch_slot = scratch_block, scratch_slot
        bs = runner.block_size
        self.max_blocks = -(-max_model_len // bs)
        rows = self.max_tokens + CHUNK
        self.rows_max = rows
        self.nt_max = rows // CHUNK + 1
        # the packed int64 inputs: ids, positions, KV slots, token -> sequence (rows each), then the
        # sample row, (q_start, q_len, ctx_len), cu_seqlens (NSEQ + 1), state slots (NSEQ), chunk table
        self.offsets: dict[str, tuple[int, int]] = {}
        at = 0
        layout = [("ids", rows), ("pos", rows), ("slots", rows), ("seq", rows), ("sample", 1), ("attn", 3)]
        layout += [("cu", NSEQ + 1), ("state", NSEQ), ("chunks", 2 * self.nt_max)]
        for name, n in layout:
            self.offsets[name] = (at, n)
            at += n
        dev = runner.device
        self.buf = torch.zeros(at, dtype=torch.int64, device=dev)
        self.size = at
        self.table = torch.full((1, self.max_blocks), scratch_block, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.pool = pool
        self.stream: torch.cuda.Stream | None = None
        self.replays = 0

    def _view(self, name: str, n: int | None = None) -> torch.Tensor:
        start, size = self.offsets[name]
        return self.buf[start : start + (size if n is None else n)]

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        return len(chunks) == 1 and 1 < chunks[0].num_tokens <= self.max_tokens and not chunks[0].drafts

    def _fill(self, host: np.ndarray, length: int, start: int, size: int, ids, blocks, slot: int) -> int:
        """Write one step's inputs into `host` (the packed layout); -> the block table's width."""
        o = self.offsets
        bs = self.runner.block_size
        rows = size + CHUNK
        a, c = padding(length, rows)

        def put(name: str, values: np.ndarray | list[int]) -> None:
            s = o[name][0]
            host[s : s + len(values)] = values

        pos = np.arange(start, start + length, dtype=np.int64)
        pad = rows - length
        blocks = np.asarray(blocks, dtype=np.int64)
        put("ids", np.concatenate([np.asarray(ids, dtype=np.int64), np.zeros(pad, np.int64)]))
        put("pos", np.concatenate([pos, np.zeros(pad, np.int64)]))
        scratch = self.scratch_block * bs + np.arange(pad, dtype=np.int64) % bs
        put("slots", np.concatenate([blocks[pos // bs] * bs + pos % bs, scratch]))
        put("seq", np.repeat(np.arange(NSEQ, dtype=np.int64), [length, a, c]))
        put("sample", [length - 1])
        put("attn", [0, length, start + length])
        put("cu", [0, length, length + a, rows])
        put("state", [slot, self.scratch_slot, self.scratch_slot])
        put("chunks", chunk_table([length, a, c]).reshape(-1))
        return -(-(start + length) // bs)

    def _forward(self, size: int) -> torch.Tensor:
        r = self.runner
        rows = size + CHUNK
        nt = rows // CHUNK + 1
        q_start, q_len, ctx_len = self._view("attn").view(3, 1)
        meta = AttentionMetadata(
            slot_mapping=self._view("slots", rows),
            num_decode_tokens=0,
            decode_groups=(),
            prefills=(),
            seq_slots=self._view("state"),
            prefill_batch=PrefillBatch(q_start, q_len, ctx_len, self.table, size),
        )
        lp = LinearPrefill(
            row0=0,
            num_rows=rows,
            cu_seqlens=self._view("cu"),
            cu_seqlens_cpu=None,  # type: ignore[arg-type]  # fla's direct call takes the chunk table
            token_seq=self._view("seq", rows).to(torch.int32),
            slots=self._view("state"),
            chunk_indices=self._view("chunks", 2 * nt).view(nt, 2),
        )
        ctx = ForwardContext(r.attn, meta, r.kv_cache, r.states, linear_prefill=lp)
        hidden = r.model(self._view("ids", rows), self._view("pos", rows), ctx)
        return r.model.compute_logits(hidden[self._view("sample")])

    @torch.inference_mode()
    def capture(self) -> float:
        with torch.cuda.device(self.runner.device):
            return self._capture()

    def _capture(self) -> float:
        import fla.utils

        t0 = time.perf_counter()
        self.stream = torch.cuda.Stream(self.runner.device)
        saved = getattr(fla.utils, "FLA_DISABLE_TENSOR_CACHE", False)
        fla.utils.FLA_DISABLE_TENSOR_CACHE = True  # recompute fla's index tensors inside the graph
        try:
            for size in reversed(self.sizes):
                host = np.zeros(self.size, dtype=np.int64)
                blocks = [self.scratch_block] * -(-size // self.runner.block_size)
                self._fill(host, size, 0, size, [0] * size, blocks, self.scratch_slot)
                self.buf.copy_(torch.from_numpy(host))
                self.table.fill_(self.scratch_block)
                self._forward(size)  # warm-up: Triton compiles and tunes at this shape
                torch.cuda.synchronize(self.runner.device)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                    self.logits[size] = self._forward(size)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size] = graph
        finally:
            fla.utils.FLA_DISABLE_TENSOR_CACHE = saved
        torch.cuda.synchronize(self.runner.device)
        seconds = time.perf_counter() - t0
        log.info("captured %d prefill CUDA graphs (chunks of up to %s tokens) in %.1f s", len(self.sizes),
                 self.sizes, seconds)  # fmt: skip
        return seconds

    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        (c,) = chunks
        req = c.request
        length = c.num_tokens
        size = next(s for s in self.sizes if s >= length)
        host = np.zeros(self.size, dtype=np.int64)
        assert req.state_slot is not None, "a hybrid-model request runs without a state slot"
        width = self._fill(host, length, c.start, size, req.token_ids(c.start, c.start + length),
                           req.block_ids, req.state_slot)  # fmt: skip
        # a fresh pinned buffer per step (torch's host allocator keeps it until the copy is done)
        self.buf.copy_(torch.from_numpy(host).pin_memory(), non_blocking=True)
        table = torch.from_numpy(np.asarray(req.block_ids[:width], dtype=np.int64)[None]).pin_memory()
        self.table[:, :width].copy_(table, non_blocking=True)
        self.graphs[size].replay()
        self.replays += 1
        if not c.samples:
            return self.logits[size][:0], []
        return self.logits[size], [c]


def graph_tokens(model: torch.nn.Module, max_num_batched_tokens: int, max_model_len: int) -> int:
    """The longest chunk to capture for `model` (0: none): hybrid models on fla's direct varlen path."""
    from splitserve.model import gdn_prefill

    if not getattr(model, "varlen", False) or gdn_prefill.VARLEN_RULE is not None:
        return 0
    if gdn_prefill.fla_forward() is None:  # fla's public call: not checked for capture
        return 0
    sizes = prefill_graph_sizes(min(env_max_tokens(), max_num_batched_tokens, max_model_len))
    return sizes[-1] if sizes else 0
