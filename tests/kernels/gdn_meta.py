"""Step metadata for the Gated DeltaNet kernel tests: decode rows, then prefill chunks back to back."""

from __future__ import annotations

import torch

from splitserve.model.attention import AttentionMetadata, PrefillChunk


def prefill_meta(nd: int, lens: tuple[int, ...], seq_slots: torch.Tensor) -> AttentionMetadata:
    """`nd` decode rows, then one fresh prefill chunk of each length in `lens`."""
    chunks, start = [], nd
    for n in lens:
        chunks.append(PrefillChunk(start, n, n, torch.zeros(1, dtype=torch.int64)))
        start += n
    return AttentionMetadata(
        slot_mapping=torch.zeros(start, dtype=torch.int64),
        num_decode_tokens=nd,
        decode_groups=(),
        prefills=tuple(chunks),
        seq_slots=seq_slots,
    )
