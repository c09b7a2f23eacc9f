"""CUDA graphs of the decode step: the model forward and the LM head, captured once at start-up for a
ladder of batch sizes (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, then every 32) over static input
buffers, and replayed for every decode-only step.

A step of B decodes pads to the next captured size: a padded row has a context of one token and writes
its K/V into a scratch block that no request owns (and, for hybrid models, its recurrent state into a
scratch state slot), so it cannot disturb real sequences. A step's inputs reach the GPU in two
host-to-device copies (the 1-D inputs packed in one pinned buffer, and the block table), and nothing
waits on the GPU until the sampler's token ids. For models without recurrent state a verify step's rows
replay these graphs too (spec/rows.py); hybrid models' verify steps have graphs of their own
(verify_graphs.py).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from splitserve.engine.spec.rows import VerifyRow, order_key, row_token, sample_rows
from splitserve.model.attention import AttentionMetadata, DecodeGroup
from splitserve.model.decoder import ForwardContext

if TYPE_CHECKING:
    from splitserve.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)


def graph_batch_sizes(max_batch: int) -> list[int]:
    """The ladder of decode batch sizes captured as CUDA graphs, up to `max_batch` (always included)."""
    ladder = [1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128]
    ladder += list(range(160, max_batch + 1, 32))
    sizes = [b for b in ladder if b < max_batch] + [max_batch]
    return sorted(set(sizes))


# An overlapped step's input tokens that are still on the device: the previous step's sampled tokens,
# and id(request) -> the row of that tensor holding the request's next input token.
Feed = tuple[torch.Tensor, dict[int, int]]


class DecodeGraphs:
    """CUDA graphs of the decode step (model forward + LM head) over a ladder of batch sizes."""

    def __init__(
        self,
        runner: Any,  # the engine's ModelRunner (its model, attention backend, KV, states, device)
        max_batch: int,
        max_model_len: int,
        scratch_block: int,
        scratch_slot: int | None,
        fresh: int = 1,
    ) -> None:
        self.runner = runner
        # the longest verify chunk whose rows (spec/rows.py) a replay may carry: so many of a row's last
        # tokens are stored by the step itself, which the attention kernel reads after its PDL wait
        self.fresh = fresh
        self.sizes = graph_batch_sizes(max_batch)
        self.max_batch = self.sizes[-1]
        self.scratch_block = scratch_block
        self.hybrid = bool(runner.states)
        if self.hybrid and scratch_slot is None:
            raise ValueError("a hybrid model's decode graphs need a scratch state slot")
        dev = runner.device
        bs = runner.block_size
        self.max_blocks = -(-max_model_len // bs)
        # rows of `inputs`: token ids, positions, KV slots, context lengths, state slots. A padded row:
        # token 0 at position 0, stored in the scratch block, a context of one token, the scratch slot
        self.pad_row = np.array([0, 0, scratch_block * bs, 1, scratch_slot or 0], dtype=np.int64)
        self.inputs = torch.empty((len(self.pad_row), self.max_batch), dtype=torch.int64, device=dev)
        self.tables = torch.empty((self.max_batch, self.max_blocks), dtype=torch.int64, device=dev)
        self.pad()
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.logits: dict[int, torch.Tensor] = {}
        self.hidden: dict[int, torch.Tensor] = {}  # each graph's final hidden states (the MTP drafter's)
        self.pool = None
        self.stream: torch.cuda.Stream | None = None  # made on our device when capturing

    def pad(self) -> None:
        """Every row of the graphs' inputs a padded row, every table entry the scratch block."""
        pad = torch.from_numpy(self.pad_row[:, None]).to(self.inputs.device)
        self.inputs.copy_(pad.expand_as(self.inputs))
        self.tables.fill_(self.scratch_block)

    def size(self, b: int) -> int:
        """The captured batch size a step of `b` rows pads to."""
        return next(s for s in self.sizes if s >= b)

    def accepts(self, chunks: list[ScheduledChunk]) -> bool:
        if not 0 < len(chunks) <= self.max_batch or any(c.num_tokens != 1 for c in chunks):
            return False
        # a verify chunk's rows attend to each other's K/V, stored by the same step (`fresh`)
        return all(not isinstance(c, VerifyRow) or c.chunk is None or c.chunk.num_tokens <= self.fresh
                   for c in chunks)  # fmt: skip

    def step_meta(self, b: int) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        from splitserve.kernels.paged_attention import decode_num_splits

        r = self.runner
        ids, pos, slots, lens, seq_slots = self.inputs[:, :b]
        splits = decode_num_splits(b, r.num_kv_heads, self.max_blocks * r.block_size, r.sm_count)
        group = DecodeGroup(0, b, self.tables[:b], lens, splits, fresh=self.fresh)
        meta = AttentionMetadata(
            slot_mapping=slots,
            num_decode_tokens=b,
            decode_groups=(group,),
            prefills=(),
            seq_slots=seq_slots if self.hybrid else None,
        )
        return ids, pos, meta

    def _forward(self, b: int) -> tuple[torch.Tensor, torch.Tensor]:
        r = self.runner
        ids, pos, meta = self.step_meta(b)
        hidden = r.model(ids, pos, ForwardContext(r.attn, meta, r.kv_cache, r.states))
        return hidden, r.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture(self) -> float:
        with torch.cuda.device(self.runner.device):  # graphs and Triton use the current device
            return self._capture()

    def _capture(self) -> float:
        import time

        t0 = time.perf_counter()
        self.stream = torch.cuda.Stream(self.runner.device)
        self.pad()  # a capture after serving (bench A/Bs) must not warm up on the last step's slots
        for b in reversed(self.sizes):  # largest first: the smaller ones reuse its memory pool
            self._forward(b)  # warm-up: Triton compiles, lazy tables are built
            torch.cuda.synchronize(self.runner.device)
            graph = torch.cuda.CUDAGraph()
            # NOTE: a capture stream of our own device: torch.cuda.graph's default one is made once per
            # process, on whichever device was current then (another engine's, in a multi-GPU process)
            with torch.cuda.graph(graph, pool=self.pool, stream=self.stream):
                self.hidden[b], self.logits[b] = self._forward(b)
            if self.pool is None:
                self.pool = graph.pool()
            self.graphs[b] = graph
        torch.cuda.synchronize(self.runner.device)
        seconds = time.perf_counter() - t0
        log.info("captured %d decode CUDA graphs (batch %s) in %.1f s", len(self.sizes), self.sizes, seconds)
        return seconds

    def run(
        self, chunks: list[ScheduledChunk], feed: Feed | None = None
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        b = len(chunks)
        fed: list[tuple[int, int]] = []  # (batch row, row of feed's tokens)
        size = self.size(b)
        bs = self.runner.block_size
        host = np.empty((5, size), dtype=np.int64)
        host[:, b:] = self.pad_row[:, None]
        width = max(-(-(c.start + 1) // bs) for c in chunks)
        table = np.full((b, width), self.scratch_block, dtype=np.int64)
        for i, c in enumerate(chunks):
            req = c.request
            p = c.start
            blocks = req.block_ids
            n = -(-(p + 1) // bs)
            if feed is not None and id(req) in feed[1]:
                fed.append((i, feed[1][id(req)]))
                host[0, i] = 0  # on the device: set below
            else:
                host[0, i] = row_token(c)
            host[1, i] = p
            host[2, i] = blocks[p // bs] * bs + p % bs
            host[3, i] = p + 1
            host[4, i] = req.state_slot if self.hybrid else 0
            table[i, :n] = blocks[:n]
        dev = self.runner.device
        pinned = dev.type == "cuda"  # (the CPU: layout tests run the graphs' forward without capture)
        host_t, table_t = torch.from_numpy(host), torch.from_numpy(table)
        self.inputs[:, :size].copy_(host_t.pin_memory() if pinned else host_t, non_blocking=pinned)
        self.tables[:b, :width].copy_(table_t.pin_memory() if pinned else table_t, non_blocking=pinned)
        if feed is not None:
            self.runner.put_fed(self.inputs[0], fed, feed[0])
        self.graphs[size].replay()
        if self.runner.needs_hidden(("decode", size)):  # the rows in the eager step's order (prepare's)
            order = sorted(range(b), key=lambda i: order_key(chunks[i]))
            rows = torch.tensor(order, dtype=torch.int64)
            rows = rows.pin_memory().to(dev, non_blocking=True) if pinned else rows
            self.runner.last_hidden = self.hidden[size][rows]
        logits = self.logits[size]
        sample, sampled = sample_rows(chunks)  # a verify chunk: a row at its last known token and each draft
        if len(sample) == b:
            return logits[:b], sampled
        rows = torch.tensor(sample, dtype=torch.int64).to(dev, non_blocking=True)
        return logits[rows], sampled
