"""A verify chunk as decode rows: for models without recurrent state, the runner lays a chunk with
drafts out as one decode row per position (each row attends to the cache up to its own position;
every row's K/V is stored before any row attends), so a step of decodes and verify chunks stays a
decode-only step: the CPU's decode layer op (kernels/cpu/layer.py), which reads the KV blocks in place,
instead of the prompt path, whose attention costs ~5x more per row at a few hundred tokens of context.
On CUDA such a step replays the decode graphs like any decode step (decode_graphs.py: one padded row
per position, `row_token` and `sample_rows` below), while its rows fit the largest one. A row attends
to its chunk's earlier rows, whose K/V the same step stores: the Triton decode kernel reads a row's
last `DecodeGroup.fresh` tokens after its PDL wait (kernels/paged_attention.py)."""

from __future__ import annotations

from dataclasses import dataclass

from splitserve.engine.scheduler import ScheduledChunk

MAX_ROWS = 17  # a longer chunk (a recompute after preemption) stays a prompt chunk


@dataclass(frozen=True)
class VerifyRow(ScheduledChunk):
    """One position of a verify chunk: its token, and whether its logits row is sampled."""

    token: int = 0
    chunk: ScheduledChunk | None = None  # the verify chunk it belongs to
    sampled: bool = False  # the last known token's position or a draft's
    last: bool = False  # the chunk's final row


def as_rows(chunks: list[ScheduledChunk]) -> list[ScheduledChunk]:
    """`chunks` with each verify chunk (drafts, at most MAX_ROWS tokens) replaced by its rows."""
    out: list[ScheduledChunk] = []
    for c in chunks:
        if not c.drafts or c.num_tokens > MAX_ROWS:
            out.append(c)
            continue
        known = c.num_tokens - len(c.drafts)
        tokens = c.request.token_ids(c.start, c.start + known) + list(c.drafts)
        for i, token in enumerate(tokens):
            sampled, last = i >= known - 1, i == len(tokens) - 1
            out.append(VerifyRow(c.request, c.start + i, 1, (), token, c, sampled, last))
    return out


def order_key(c: ScheduledChunk) -> tuple[bool, int]:
    """The runner's order: decode rows first, by context length (a verify chunk's rows together, at
    its start), then prompt chunks."""
    if isinstance(c, VerifyRow):
        assert c.chunk is not None
        return False, c.chunk.start
    return c.num_tokens > 1, c.start if c.num_tokens == 1 else 0


def row_token(c: ScheduledChunk) -> int:
    """The input token of a one-token chunk or verify row."""
    return c.token if isinstance(c, VerifyRow) else c.request.token_ids(c.start, c.start + 1)[0]


def sample_rows(rows: list[ScheduledChunk]) -> tuple[list[int], list[ScheduledChunk]]:
    """Of a step of one-token chunks and verify rows: the rows whose logits are sampled, and the chunks
    they belong to (a verify chunk once, at its last row), in order."""
    sampled = [i for i, c in enumerate(rows) if (c.sampled if isinstance(c, VerifyRow) else c.samples)]
    chunks = [c.chunk if isinstance(c, VerifyRow) else c for c in rows
              if (c.last if isinstance(c, VerifyRow) else c.samples)]  # fmt: skip
    return sampled, chunks  # type: ignore[return-value]
