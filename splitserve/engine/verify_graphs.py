"""CUDA graphs of hybrid models' verify steps: a step of a few requests in their decode phase, some with
drafts, replayed as decode rows.

Eagerly a hybrid model verifies a chunk of drafts as a prompt chunk (the chunked gated delta rule),
which launches several hundred kernels a step; a speculating request at batch 1 would then pay more
for its step than the drafts save. Here such a step is laid out as `steps` runs of `width` decode rows
(`AttentionMetadata.decode_steps`): run j holds position j of every request of the step, in the same
column each run. The full-attention layers see plain decode rows (each row stores its K/V and attends
to the cache up to its own position; every row's K/V is stored before any row attends), and the Gated
DeltaNet layers advance the recurrent and conv states one run after another with the decode kernels,
in place on each request's state slot, so that after the replay a slot holds the state after the
chunk's last token, exactly what the eager step leaves. Rollback is unchanged (spec/verify.py: the
slot is copied before the step and restored when a draft was rejected). A row's last `steps` tokens
are stored by the step itself, so the decode attention reads them after its PDL wait
(`DecodeGroup.fresh`; kernels/paged_attention.py), not among its early reads.

A request with fewer tokens than `steps` (a plain decode among verify chunks, or a chunk shorter than
the longest) fills its column's remaining rows with padded rows: token 0 at position 0, its K/V into
the scratch block, its state into the scratch state slot, as the decode graphs pad (decode_graphs.py).

Graphs are captured for each `width` of the decode ladder up to the batch at which drafting stops
(`disable_by_batch_size`) and each `steps` from 2 to 2k + 1 (a chunk re-computed after a rejection
holds up to k + 1 known tokens and k drafts), at most `MAX_STEPS`. They share the decode graphs'
memory pool and one output buffer for the logits and one for the final hidden states (the MTP
drafter reads them), so their memory is one step's activations, not one per graph. A step that does
not fit (more requests, a longer chunk, a prompt chunk) runs eagerly.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from splitserve.engine.decode_graphs import graph_batch_sizes
from splitserve.engine.spec.rows import order_key
from splitserve.model.attention import AttentionMetadata, DecodeGroup
from splitserve.model.decoder import ForwardContext

if TYPE_CHECKING:
    from splitserve.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

MAX_STEPS = 9  # positions a request in a captured verify step, at most (2k + 1 for k = 4)
MAX_WIDTH = 8  # requests in a captured verify step, at most


def verify_graph_shapes(k: int, max_batch: int, drafting_batch: int | None) -> list[tuple[int, int]]:
    """(width, steps) of each verify graph for k drafts a request, drafting below `drafting_batch`
    running requests (None: at any batch), largest first."""
    cap = min(max_batch, MAX_WIDTH if drafting_batch is None else min(drafting_batch, MAX_WIDTH))
    steps = range(2, min(2 * k + 1, MAX_STEPS) + 1)
    shapes = [(w, s) for w in graph_batch_sizes(max(cap, 1)) for s in steps]
    return sorted(shapes, key=lambda ws: -ws[0] * ws[1])


@dataclass(frozen=True)
class VerifyLayout:
    """One step's rows, as the graph of (width, steps) reads them."""

    host: np.ndarray  # [5, width * steps] int64: token ids, positions, KV slots, context lengths, state slots
    table: np.ndarray  # [width * steps, blocks] int64: each row's block table
    sample: list[int]  # the rows whose logits are sampled, chunk by chunk in the runner's order
    chunks: list[ScheduledChunk]  # the chunks those rows belong to, in that order
    hidden: list[int]  # every chunk's rows, position by position, chunk by chunk in the runner's order


def verify_layout(
    chunks: list[ScheduledChunk], width: int, steps: int, block_size: int, pad_row: np.ndarray,
    scratch_block: int,
) -> VerifyLayout:  # fmt: skip
    """`chunks` (at most `width`, each at most `steps` tokens) as `steps` runs of `width` rows: chunk i's
    position j at row j * width + i. The rows returned for sampling and for the hidden states follow
    the eager step's order (`order_key`; a chunk's rows at its last known token and at each draft)."""
    n = width * steps
    host = np.repeat(pad_row[:, None], n, axis=1)
    bs = block_size
    table = np.full((n, -(-max(c.start + c.num_tokens for c in chunks) // bs)), scratch_block, np.int64)
    for i, c in enumerate(chunks):
        req = c.request
        known = c.num_tokens - len(c.drafts)
        tokens = req.token_ids(c.start, c.start + known) + list(c.drafts)
        blocks = np.asarray(req.block_ids, dtype=np.int64)
        pos = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
        rows = np.arange(c.num_tokens) * width + i
        host[0, rows] = tokens
        host[1, rows] = pos
        host[2, rows] = blocks[pos // bs] * bs + pos % bs
        host[3, rows] = pos + 1
        host[4, rows] = req.state_slot
        used = -(-(c.start + c.num_tokens) // bs)
        table[rows, :used] = blocks[:used]
    sample: list[int] = []
    sampled: list[ScheduledChunk] = []
    hidden: list[int] = []
    for i in sorted(range(len(chunks)), key=lambda i: order_key(chunks[i])):
        c = chunks[i]
        rows_i = [j * width + i for j in range(c.num_tokens)]
        hidden += rows_i
        if c.drafts:
            sample += rows_i[c.num_tokens - 1 - len(c.drafts) :]
        elif c.samples:
            sample.append(rows_i[-1])
        if c.drafts or c.samples:
            sampled.append(c)
    return VerifyLayout(host, table, sample, sampled, hidden)


class VerifyGraphs:
    """CUDA graphs of a hybrid model's verify step (forward + LM head) per (width, steps)."""

    def __init__(
        self,
        runner: Any,  # the engine's ModelRunner (its model, attention backend, KV, states, device)
        shapes: list[tuple[int, int]],
        max_model_len: int,
        scratch_block: int,
        scratch_slot: int,
        pool: object = None,
    ) -> None:
        self.runner = runner
        self.shapes = sorted(shapes, key=lambda ws: -ws[0] * ws[1])
        self.widths = sorted({w for w, _ in shapes})
        self.max_steps = max(s for _, s in shapes)
        self.max_rows = max(w * s for w, s in shapes)
        self.scratch_block = scratch_block
        self.max_blocks = -(-max_model_len // runner.block_size)
        # a padded row: token 0 at position 0, stored in the scratch block, a context of one token, the
        # scratch state slot (rows of `inputs` as `VerifyLayout.host`)
        self.pad_row = np.array([0, 0, scratch_block * runner.block_size, 1, scratch_slot], dtype=np.int64)
        dev = runner.device
        self.inputs = torch.from_numpy(np.repeat(self.pad_row[:, None], self.max_rows, axis=1)).to(dev)
        rows, blocks = self.max_rows, self.max_blocks
        self.tables = torch.full((rows, blocks), scratch_block, dtype=torch.int64, device=dev)
        self.logits: torch.Tensor | None = None  # [max_rows, vocab]: every graph's output, made at capture
        self.hidden: torch.Tensor | None = None  # [max_rows, hidden]: the final hidden states, likewise
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.pool = pool
        self.stream: torch.cuda.Stream | None = None
        self.replays = 0

    def shape(self, chunks: list[ScheduledChunk]) -> tuple[int, int] | None:
        """The (width, steps) graph that runs `chunks`, or None: a step of requests in their decode phase
        (no prompt chunk), at least one of more than one token, that fits a captured graph."""
        if not chunks or len(chunks) > self.widths[-1]:
            return None
        steps = max(c.num_tokens for c in chunks)
        if not 2 <= steps <= self.max_steps:
            return None
        if any(c.start < c.request.num_prompt_tokens for c in chunks):
            return None
        width = next(w for w in self.widths if w >= len(chunks))
        return (width, steps) if (width, steps) in self.graphs else None

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        return self.shape(chunks) is not None

    def step_meta(self, width: int, steps: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """(token ids, positions, metadata) of the first width * steps rows of the static inputs."""
        from splitserve.kernels.paged_attention import decode_num_splits

        r = self.runner
        n = width * steps
        ids, pos, slots, lens, seq_slots = self.inputs[:, :n]
        splits = decode_num_splits(n, r.num_kv_heads, self.max_blocks * r.block_size, r.sm_count)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=n,
            # a row attends to its chunk's earlier rows, stored by this step too (kernels/pdl.py)
            decode_groups=(DecodeGroup(0, n, self.tables[:n], lens, splits, fresh=steps),),
            prefills=(),
            seq_slots=seq_slots,
            decode_steps=steps,
        )
        return ids, pos, meta

    def forward(self, width: int, steps: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The model over the first width * steps rows of the static inputs -> (hidden, logits)."""
        r = self.runner
        ids, pos, meta = self.step_meta(width, steps)
        hidden = r.model(ids, pos, ForwardContext(r.attn, meta, r.kv_cache, r.states))
        return hidden, r.model.compute_logits(hidden)

    def pad(self) -> None:
        """Every row of the static inputs a padded row, every table entry the scratch block."""
        self.inputs.copy_(torch.from_numpy(np.repeat(self.pad_row[:, None], self.max_rows, axis=1)))
        self.tables.fill_(self.scratch_block)

    def load(self, layout: VerifyLayout) -> None:
        """Copy a step's rows into the static inputs (two host-to-device copies, no host wait)."""
        n, blocks = layout.table.shape
        pinned = self.runner.device.type == "cuda"
        host, table = torch.from_numpy(layout.host), torch.from_numpy(layout.table)
        self.inputs[:, :n].copy_(host.pin_memory() if pinned else host, non_blocking=pinned)
        self.tables[:n, :blocks].copy_(table.pin_memory() if pinned else table, non_blocking=pinned)

    @torch.inference_mode()
    def capture(self) -> float:
        with torch.cuda.device(self.runner.device):  # graphs and Triton use the current device
            return self._capture()

    def _capture(self) -> float:
        t0 = time.perf_counter()
        dev = self.runner.device
        self.stream = torch.cuda.Stream(dev)
        self.pad()
        for width, steps in self.shapes:  # largest first: the smaller ones reuse its memory pool
            hidden, logits = self.forward(width, steps)  # warm-up: Triton compiles at these shapes
            if self.logits is None:  # the shared outputs, outside every graph's pool
                self.logits = logits.new_empty((self.max_rows, logits.shape[1]))
                self.hidden = hidden.new_empty((self.max_rows, hidden.shape[1]))
            del hidden, logits
            torch.cuda.synchronize(dev)
            graph = torch.cuda.CUDAGraph()
            n = width * steps
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                hidden, logits = self.forward(width, steps)
                self.logits[:n].copy_(logits)
                self.hidden[:n].copy_(hidden)  # type: ignore[index]
                del hidden, logits
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[(width, steps)] = graph
        torch.cuda.synchronize(dev)
        seconds = time.perf_counter() - t0
        log.info("captured %d verify CUDA graphs ((requests, positions) %s) in %.1f s", len(self.graphs),
                 self.shapes, seconds)  # fmt: skip
        return seconds

    def run(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        shape = self.shape(chunks)
        assert shape is not None and self.logits is not None and self.hidden is not None
        width, steps = shape
        r = self.runner
        layout = verify_layout(chunks, width, steps, r.block_size, self.pad_row, self.scratch_block)
        self.load(layout)
        self.graphs[shape].replay()
        self.replays += 1
        if r.needs_hidden(("verify", shape)):  # the eager step's rows, in its order (the MTP drafter's)
            r.last_hidden = self.hidden[_index(layout.hidden, r.device)]
        return self.logits[_index(layout.sample, r.device)], layout.chunks


def _index(rows: list[int], device: torch.device) -> torch.Tensor:
    t = torch.tensor(rows, dtype=torch.int64)
    return t.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else t
