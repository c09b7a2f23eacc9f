"""Turns a scheduled step into tensors, runs the model, and returns logits for the rows to sample.

The flat batch puts single-token chunks (decodes) first, then multi-token chunks (prefills), which is
the order `AttentionMetadata` expects.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from splitserve.engine.scheduler import ScheduledChunk
from splitserve.model.attention import AttentionBackend, AttentionMetadata, DecodeGroup, PrefillChunk
from splitserve.model.decoder import DecoderLM, ForwardContext

# More groups cost more kernel launches than the padding they save: on CUDA (launch-bound without
# CUDA graphs) one group, on CPU (bound by the bytes the gather copies) up to four.
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
        self.kv = kv
        self.states = states or {}
        self.attn = attn
        self.block_size = block_size
        self.device = kv.device
        self.max_decode_groups = MAX_DECODE_GROUPS.get(self.device.type, 1)

    @torch.inference_mode()
    def execute(self, chunks: list[ScheduledChunk]) -> tuple[torch.Tensor, list[ScheduledChunk]]:
        """Run one step; returns logits [N, vocab] (fp32) and the chunks they belong to."""
        inputs = self.prepare(chunks)
        ctx = ForwardContext(self.attn, inputs.meta, self.kv, self.states)
        hidden = self.model(inputs.input_ids, inputs.positions, ctx)
        if not inputs.sample_chunks:
            return hidden.new_empty((0, self.model.cfg.vocab_size)), []
        return self.model.compute_logits(hidden[inputs.sample_rows]), inputs.sample_chunks

    def prepare(self, chunks: list[ScheduledChunk]) -> StepInputs:
        # decodes first, shortest context first (so length groups are contiguous), then prefills
        ordered = sorted(chunks, key=lambda c: (c.num_tokens > 1, c.start if c.num_tokens == 1 else 0))
        ids: list[int] = []
        positions: list[np.ndarray] = []
        slots: list[np.ndarray] = []
        sample_rows: list[int] = []
        sample_chunks: list[ScheduledChunk] = []
        prefills: list[PrefillChunk] = []
        prefills_chunks: list[ScheduledChunk] = []
        decodes: list[ScheduledChunk] = []
        for c in ordered:
            req = c.request
            start = len(ids)
            ids.extend(req.token_ids(c.start, c.start + c.num_tokens))
            pos = np.arange(c.start, c.start + c.num_tokens, dtype=np.int64)
            blocks = np.asarray(req.block_ids, dtype=np.int64)
            positions.append(pos)
            slots.append(blocks[pos // self.block_size] * self.block_size + pos % self.block_size)
            if c.num_tokens == 1:
                decodes.append(c)
            else:
                ctx_len = c.start + c.num_tokens
                table = torch.from_numpy(blocks[: -(-ctx_len // self.block_size)]).to(self.device)
                prefills.append(PrefillChunk(start, c.num_tokens, ctx_len, table))
                prefills_chunks.append(c)
            if c.samples:
                sample_rows.append(len(ids) - 1)
                sample_chunks.append(c)
        meta = AttentionMetadata(
            slot_mapping=self._tensor(np.concatenate(slots)),
            num_decode_tokens=len(decodes),
            decode_groups=self._decode_groups(decodes),
            prefills=tuple(prefills),
            seq_slots=self._slots(decodes, prefills_chunks) if self.states else None,
        )
        return StepInputs(
            input_ids=self._tensor(np.asarray(ids, dtype=np.int64)),
            positions=self._tensor(np.concatenate(positions)),
            meta=meta,
            sample_rows=self._tensor(np.asarray(sample_rows, dtype=np.int64)),
            sample_chunks=sample_chunks,
        )

    def _decode_groups(self, decodes: list[ScheduledChunk]) -> tuple[DecodeGroup, ...]:
        """Split decodes (sorted by context length) so that padding stays under ~25% per group."""
        lens = [c.start + 1 for c in decodes]
        bounds: list[tuple[int, int]] = []
        start, total = 0, 0
        for i, n in enumerate(lens):
            total += n
            too_padded = (i + 1 - start) * n > 1.25 * total
            if i > start and too_padded and len(bounds) < self.max_decode_groups - 1:
                bounds.append((start, i))
                start, total = i, n
        if decodes:
            bounds.append((start, len(decodes)))
        return tuple(self._decode_group(decodes, a, b) for a, b in bounds)

    def _decode_group(self, decodes: list[ScheduledChunk], start: int, end: int) -> DecodeGroup:
        bs = self.block_size
        width = -(-(decodes[end - 1].start + 1) // bs)
        table = np.zeros((end - start, width), dtype=np.int64)
        for i, c in enumerate(decodes[start:end]):
            n = -(-(c.start + 1) // bs)
            table[i, :n] = c.request.block_ids[:n]
        lens = np.array([c.start + 1 for c in decodes[start:end]], dtype=np.int64)
        return DecodeGroup(start, end, self._tensor(table), self._tensor(lens))

    def _slots(self, decodes: list[ScheduledChunk], prefills: list[ScheduledChunk]) -> torch.Tensor:
        slots = [c.request.state_slot for c in decodes + prefills]
        assert None not in slots, "a hybrid-model request runs without a state slot"
        return self._tensor(np.asarray(slots, dtype=np.int64))

    def _tensor(self, a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a).to(self.device, non_blocking=True)
