"""Turns a scheduled step into tensors, runs the model, and returns logits for the rows to sample.

The flat batch puts single-token chunks (decodes) first, then multi-token chunks (prefills), which is
the order `AttentionMetadata` expects.

On CUDA with the Triton attention backend, decode-only steps replay CUDA graphs (decode_graphs.py).
For hybrid models a step of one short prefill chunk replays a prefill graph (prefill_graphs.py), and a
verify step of a few requests a verify graph (verify_graphs.py); other mixed and prefill steps run
eagerly. With the MTP drafter, its head's runs replay graphs of their own (spec/mtp_graphs.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitserve.engine.decode_graphs import DecodeGraphs, Feed
from splitserve.engine.isolate import check_fault
from splitserve.engine.prefill_graphs import PrefillGraphs
from splitserve.engine.scheduler import ScheduledChunk
from splitserve.engine.spec.rows import VerifyRow, as_rows, order_key
from splitserve.engine.verify_graphs import VerifyGraphs
from splitserve.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    DecodeGroup,
    PrefillBatch,
    PrefillChunk,
    TorchPagedAttention,
)
from splitserve.model.decoder import DecoderLM, ForwardContext

if TYPE_CHECKING:
    from splitserve.engine.spec.mtp_graphs import HeadGraphs

log = logging.getLogger(__name__)

# More groups cost more kernel launches than the padding they save: on CUDA (one kernel reads every
# length) one group, on CPU (bound by the bytes the gather copies) up to four.
MAX_DECODE_GROUPS = {"cpu": 4}


@dataclass(frozen=True)
class StepInputs:
    input_ids: torch.Tensor  # [T]
    positions: torch.Tensor  # [T]
    meta: AttentionMetadata
    sample_rows: torch.Tensor  # [N] rows of the flat batch whose logits are sampled
    sample_chunks: list[ScheduledChunk]


class ModelRunner:
    def __init__(
        self,
        model: DecoderLM,
        kv: torch.Tensor,
        attn: AttentionBackend,
        block_size: int,
        states: dict[str, torch.Tensor] | None = None,
    ) -> None:
        self.model = model
        self.kv_cache = kv
        self.states = states or {}
        self.attn = attn
        self.block_size = block_size
        self.device = kv.device
        self.max_decode_groups = MAX_DECODE_GROUPS.get(self.device.type, 1)
        self.num_kv_heads = kv.shape[4]
        self.sm_count = (
            torch.cuda.get_device_properties(self.device).multi_processor_count
            if self.device.type == "cuda"
            else 0
        )
        self.graphs: DecodeGraphs | None = None
        self.prefill_graphs: PrefillGraphs | None = None  # short one-chunk prefills (hybrid models)
        self.verify_graphs: VerifyGraphs | None = None  # verify steps of a few requests (hybrid models)
        # keep_hidden: each step leaves the model's final hidden states of its rows in `last_hidden`, in
        # `prepare`'s order (the MTP drafter reads them); steps whose graphs do not keep them run eagerly
        self.keep_hidden = False
        self.last_hidden: torch.Tensor | None = None
        self.head_graphs: HeadGraphs | None = None  # the MTP head's runs (spec/mtp_graphs.py)
        # the graph the last step replayed: ("decode", batch), ("verify", (width, steps)) or None (eager);
        # the MTP head's catch-up graphs read that graph's static buffers
        self.replayed: tuple[str, object] | None = None

    def enable_cuda_graphs(
        self, max_batch: int, max_model_len: int, scratch_block: int, scratch_slot: int | None, fresh: int = 1
    ) -> float:
        """Capture the decode graphs (CUDA, Triton backend); -> seconds it took. `fresh`: the longest
        verify chunk whose rows they may replay (decode_graphs.py)."""
        self.graphs = DecodeGraphs(self, max_batch, max_model_len, scratch_block, scratch_slot, fresh)
        return self.graphs.capture()

    def enable_prefill_graphs(
        self, max_tokens: int, max_model_len: int, scratch_block: int, scratch_slot: int
    ) -> float:
        """Capture one-chunk prefill graphs up to `max_tokens` (prefill_graphs.py); -> seconds it took."""
        from splitserve.engine.prefill_graphs import PrefillGraphs, prefill_graph_sizes

        sizes = prefill_graph_sizes(max_tokens)
        if not sizes:
            return 0.0
        pool = self.graphs.pool if self.graphs is not None else None
        self.prefill_graphs = PrefillGraphs(self, sizes, max_model_len, scratch_block, scratch_slot, pool)
        return self.prefill_graphs.capture()

    def enable_verify_graphs(
        self, shapes: list[tuple[int, int]], max_model_len: int, scratch_block: int, scratch_slot: int
    ) -> float:
        """Capture a hybrid model's verify graphs of (requests, positions) `shapes` (verify_graphs.py);
        -> seconds it took."""
        pool = self.graphs.pool if self.graphs is not None else None
        self.verify_graphs = VerifyGraphs(self, shapes, max_model_len, scratch_block, scratch_slot, pool)
        return self.verify_graphs.capture()

    def enable_head_graphs(self, head: torch.nn.Module, k: int, draft_batch: int, max_model_len: int,
                           scratch_block: int) -> float:  # fmt: skip
        """Capture the MTP head's graphs (spec/mtp_graphs.py) after the decode and verify graphs; -> seconds
        it took. `k`: the most drafts a request makes; `draft_batch`: the most requests that draft."""
        from splitserve.engine.spec.mtp_graphs import HeadGraphs

        self.head_graphs = HeadGraphs(self, head, k, draft_batch, max_model_len, scratch_block)
        return self.head_graphs.capture()

    def needs_hidden(self, replayed: tuple[str, object]) -> bool:
        """Whether a step replayed as `replayed` must leave its hidden states in `last_hidden`: the MTP
        drafter reads them, unless its head's catch-up replays a graph on that graph's buffers."""
        return self.keep_hidden and (self.head_graphs is None or not self.head_graphs.covers(replayed))

    @torch.inference_mode()
    def execute(
        self, chunks: list[ScheduledChunk], feed: Feed | None = None
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Run one step; returns logits [N, vocab] (fp32) and the chunks they belong to (a chunk with
        drafts has 1 + len(drafts) consecutive rows, the others one each). `feed`: the
        input tokens of some decode chunks come from the previous step's sampled tokens on the device
        (their host copy is a placeholder until that step is resolved: the engine's overlap)."""
        check_fault(chunks)  # a test hook (isolate.py); a no-op in production
        if self.device.type == "cuda":
            # NOTE: Triton launches on the *current* device, whatever its tensors' device: make it ours
            with torch.cuda.device(self.device):
                return self._execute(chunks, feed)
        return self._execute(chunks, feed)

    def _execute(
        self, chunks: list[ScheduledChunk], feed: Feed | None
    ) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        rows = chunks if self.states or self.graphs is None else as_rows(chunks)  # verify chunks: rows.py
        self.replayed = None
        if self.graphs is not None and self.graphs.accepts(rows):
            self.replayed = ("decode", self.graphs.size(len(rows)))
            return self.graphs.run(rows, feed)
        if self.verify_graphs is not None and feed is None and self.verify_graphs.accepts(chunks):
            self.replayed = ("verify", self.verify_graphs.shape(chunks))
            return self.verify_graphs.run(chunks)
        if self.prefill_graphs is not None and not self.keep_hidden and self.prefill_graphs.accepts(chunks):
            return self.prefill_graphs.run(chunks)
        inputs = self.prepare(chunks, feed)
        ctx = ForwardContext(self.attn, inputs.meta, self.kv_cache, self.states)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        self.last_hidden = hidden if self.keep_hidden else None
        if not inputs.sample_chunks:
            return hidden.new_empty((0, self.model.cfg.vocab_size)), []
        return self.model.compute_logits(hidden[inputs.sample_rows]), inputs.sample_chunks

    def prepare(
        self, chunks: list[ScheduledChunk], feed: Feed | None = None, ahead: bool = False
    ) -> StepInputs:
        """The flat step inputs of `chunks`, each chunk's rows at its positions. `ahead`: the chunks may
        reach past their requests' known tokens (the MTP head's runs, spec/mtp.py, which take their
        tokens apart): those positions get placeholder ids, so every chunk still has its rows."""
        # decodes first, shortest context first (so length groups are contiguous), then prefills; without
        # recurrent state a verify chunk runs as decode rows (spec/rows.py)
        ordered = sorted(chunks if self.states else as_rows(chunks), key=order_key)
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        prefills: list[PrefillChunk] = []
        prefill_blocks: list[np.ndarray] = []
        prefills_chunks: list[ScheduledChunk] = []
        decodes: list[ScheduledChunk] = []
        fed: list[tuple[int, int]] = []  # (row of the flat batch, row of feed's tokens)
        batched = self.attn.batched_prefill
        for c in ordered:
            req = c.request
            start = len(ids)
            if feed is not None and c.num_tokens == 1 and id(req) in feed[1]:
                fed.append((start, feed[1][id(req)]))
                ids.append(0)  # the token is on the device: set below
            elif isinstance(c, VerifyRow):
                ids.append(c.token)
            else:
                ids.extend(_chunk_ids(c, ahead))
            pos = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            if c.num_tokens == 1:
                decodes.append(c)
            else:
                ctx_len = c.start + c.num_tokens
                used = blocks[: -(-ctx_len // self.block_size)]
                table = None if batched else self._tensor(used)
                prefills.append(PrefillChunk(start, c.num_tokens, ctx_len, table))
                prefill_blocks.append(used)
                prefills_chunks.append(c)
            if isinstance(c, VerifyRow):
                sample_rows += [len(ids) - 1] if c.sampled else []
                sample_chunks += [c.chunk] if c.last else []  # type: ignore[list-item]
            elif c.samples:  # with drafts: a row at the last known token and at each draft
                sample_rows.extend(range(len(ids) - 1 - len(c.drafts), len(ids)))
                sample_chunks.append(c)
        host = [np.asarray(ids, dtype=np.int64), np.concatenate(positions), np.concatenate(slots),
                np.asarray(sample_rows, dtype=np.int64)]  # fmt: skip
        if self.states:
            host.append(self._slots(decodes, prefills_chunks))
        if batched and prefills:
            host += _prefill_columns(prefills, prefill_blocks)
        dev = self._tensors(host)
        meta = AttentionMetadata(
            slot_mapping=dev[2],
            num_decode_tokens=len(decodes),
            decode_groups=self._decode_groups(decodes),
            prefills=tuple(prefills),
            seq_slots=dev[4] if self.states else None,
            prefill_batch=_prefill_batch(prefills, dev[-2], dev[-1]) if batched and prefills else None,
        )
        if feed is not None:
            self.put_fed(dev[0], fed, feed[0])
        return StepInputs(
            input_ids=dev[0], positions=dev[1], meta=meta, sample_rows=dev[3], sample_chunks=sample_chunks
        )

    def _tensors(self, arrays: list[np.ndarray]) -> list[torch.Tensor]:
        """int64 `arrays` on the device through one staging buffer (pinned on CUDA): one host-to-device
        copy a step instead of one per array, each array a view of it starting 16-byte aligned."""
        offsets, n = [], 0
        for a in arrays:
            offsets.append(n)
            n += a.size + (a.size & 1)  # even element counts keep every view 16-byte aligned
        staging = torch.empty(n, dtype=torch.int64, pin_memory=self.device.type == "cuda")
        flat = staging.numpy()
        for a, off in zip(arrays, offsets, strict=True):
            flat[off : off + a.size] = a.ravel()
        on_device = staging.to(self.device, non_blocking=True)
        return [on_device[off : off + a.size].view(a.shape) for a, off in zip(arrays, offsets, strict=True)]

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> tuple[DecodeGroup, ...]:
        """Split decodes (sorted by context length) so that padding stays under ~25% per group. One group
        where the CPU's paged decode op reads the blocks in place (kernels/cpu/attention.py): padding
        costs it nothing, and one group lets a decode-only step take kernels/cpu/layer.py's op."""
        lens = [c.start + 1 for c in decodes]
        in_place = isinstance(self.attn, TorchPagedAttention) and self.attn.reads_in_place(self.kv_cache)
        groups = 1 if in_place else self.max_decode_groups
        bounds: list[tuple[int, int]] = []
        start, total = 0, 0
        for i, n in enumerate(lens):
            total += n
            too_padded = (i + 1 - start) * n > 1.25 * total
            if i > start and too_padded and len(bounds) < groups - 1:
                bounds.append((start, i))
                start, total = i, n
        if decodes:
            bounds.append((start, len(decodes)))
        return tuple(self._decode_group(decodes, a, b) for a, b in bounds)

    def _decode_group(self, decodes: list[ScheduledChunk], start: int, end: int) -> DecodeGroup:
        bs = self.block_size
        width = -(-(max(c.start for c in decodes[start:end]) + 1) // bs)
        table = np.zeros((end - start, width), dtype=np.int64)
        for i, c in enumerate(decodes[start:end]):
            n = -(-(c.start + 1) // bs)
            table[i, :n] = c.request.block_ids[:n]
        lens = np.array([c.start + 1 for c in decodes[start:end]], dtype=np.int64)
        splits = 1
        if self.attn.batched_prefill:  # the Triton backend: split long contexts when rows are few
            from splitserve.kernels.paged_attention import decode_num_splits

            splits = decode_num_splits(end - start, self.num_kv_heads, int(lens.max()), self.sm_count)
        # verify rows attend to their chunk's earlier rows, which the step stores too (kernels/pdl.py)
        fresh = max((c.chunk.num_tokens for c in decodes[start:end] if isinstance(c, VerifyRow) and c.chunk),
                    default=1)  # fmt: skip
        return DecodeGroup(start, end, self._tensor(table), self._tensor(lens), splits, fresh)

    def _slots(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> np.ndarray:
        slots = [c.request.state_slot for c in decodes + prefills]
        assert None not in slots, "a hybrid-model request runs without a state slot"
        return np.asarray(slots, dtype=np.int64)

    def put_fed(self, input_ids: torch.Tensor, fed: list[tuple[int, int]], tokens: torch.Tensor) -> None:
        """input_ids[row] = tokens[src] for each (row, src) of `fed`, on the device (no host wait)."""
        if not fed:
            return
        if all(i == j for i, j in fed) and fed[-1][0] == len(fed) - 1:  # same rows, same order: a copy
            input_ids[: len(fed)].copy_(tokens[: len(fed)])
            return
        rows = self._tensor(np.asarray(fed, dtype=np.int64).T.copy())
        input_ids[rows[0]] = tokens[rows[1]]

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        t = torch.from_numpy(a)
        if self.device.type == "cuda":
            t = t.pin_memory()
        return t.to(self.device, non_blocking=True)


def _prefill_columns(prefills: list[PrefillChunk], blocks: list[np.ndarray]) -> list[np.ndarray]:
    """The batched prefill's host arrays: its [3, P] (query start, query length, context length) rows
    and its [P, max blocks] block table, zero-padded."""
    cols = np.array([(p.query_start, p.query_len, p.context_len) for p in prefills], dtype=np.int64)
    table = np.zeros((len(blocks), max(len(b) for b in blocks)), dtype=np.int64)
    for i, b in enumerate(blocks):
        table[i, : len(b)] = b
    return [np.ascontiguousarray(cols.T), table]


def _prefill_batch(prefills: list[PrefillChunk], cols: torch.Tensor, table: torch.Tensor) -> PrefillBatch:
    """`_prefill_columns`' arrays on the device as a `PrefillBatch`."""
    return PrefillBatch(cols[0], cols[1], cols[2], table, max(p.query_len for p in prefills))


def _chunk_ids(c: ScheduledChunk, ahead: bool) -> list[int]:
    """The input ids of chunk `c`, one per position: its request's known tokens, then its drafts; with
    `ahead`, 0 at positions past the request's known tokens (see `prepare`)."""
    ids = c.request.token_ids(c.start, c.start + c.num_tokens - len(c.drafts)) + list(c.drafts)
    missing = c.num_tokens - len(ids)
    assert ahead or missing == 0, f"a chunk at {c.start} of {c.num_tokens} reaches past its request's tokens"
    return ids + [0] * missing
