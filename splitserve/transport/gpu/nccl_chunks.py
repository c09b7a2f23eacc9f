"""The blocks of one nccl transfer as messages over a two-rank group (nccl.py): each side queues one
message per chunk of `per` blocks. A chunk whose ids are one run of the cache is sent from (or received
into) the cache itself; any other goes through one of up to STAGING_BUFS staging buffers: gathered into
it before its send (gathering chunk k+1 overlaps sending chunk k), or received into it and scattered
from there (receives run ahead of scatters).

`rows` is the KV cache seen as one row of bytes per block ([num_blocks, block_nbytes], blocks.py).
The caller holds the device and stream (GpuMover.on_device) and turns a RuntimeError into the
transfer's error.
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch

from splitserve.transport.gpu.blocks import consecutive_start, index_tensor, wide
from splitserve.transport.gpu.nccl_group import chunk_spans
from splitserve.transport.trace import gpu_mark, mark

STAGING_BUFS = 3  # staged chunks in flight per transfer side (gathering / sending / scattering)


def staging(rows: torch.Tensor, per: int, count: int) -> torch.Tensor:
    """`count` chunk-sized buffers [count, per, block_nbytes] on the cache's device, for one transfer
    (the caching allocator makes them cheap; concurrent transfers each get their own)."""
    return torch.empty((count, per, rows.shape[1]), dtype=torch.uint8, device=rows.device)


def queue_sends(group: Any, rows: torch.Tensor, ids: np.ndarray, per: int) -> tuple[list[Any], float]:
    """Queue the gathers and sends (to rank 1) of every chunk; -> (the works not waited for yet, the
    seconds spent in c10d's send calls)."""
    works: list[Any] = []
    waited: set[int] = set()
    index = bufs = None
    spans = chunk_spans(len(ids), per)
    calls = 0.0
    for k, (a, b) in enumerate(spans):
        first = consecutive_start(ids[a:b])
        if first is not None:
            chunk = rows[first : first + b - a]
        else:
            if index is None or bufs is None:
                index = index_tensor(ids, rows.device)
                bufs = staging(rows, per, min(STAGING_BUFS, len(spans)))
            reuse = k - len(bufs)
            if reuse >= 0 and reuse not in waited:
                works[reuse].wait()  # the buffer's last send is done before we refill it
                waited.add(reuse)
            chunk = bufs[k % len(bufs)][: b - a]
            src, out = wide(rows, chunk)
            torch.index_select(src, 0, index[a:b], out=out)
        start = time.perf_counter()
        gpu_mark("e.send_queued", rows.device)
        works.append(group.send([chunk], 1, 0))
        calls += time.perf_counter() - start
        mark("e.send_called")
    return [w for i, w in enumerate(works) if i not in waited], calls  # Gloo: a work waits once


def queue_recvs(group: Any, rows: torch.Tensor, ids: np.ndarray, per: int) -> tuple[list[Any], int]:
    """Queue the receives (from rank 0) and scatters of every chunk on the current stream; -> the works
    to wait for, and how many chunks went through staging.

    A chunk's scatter is queued only when its buffer is needed again, so receives run ahead of scatters
    and the two overlap (a receive waits for the stream as it is when queued, which then holds the
    scatter of the buffer's last chunk)."""
    spans = chunk_spans(len(ids), per)
    works: list[Any] = []
    index = bufs = None
    pending: list[tuple[Any, torch.Tensor, int, int]] = []  # received, not yet scattered
    staged = 0

    def scatter_oldest() -> None:
        work, chunk, a, b = pending.pop(0)
        work.wait()  # the stream waits for the receive (Gloo: it is done)
        dst, src = wide(rows, chunk)
        dst.index_copy_(0, index[a:b], src)

    for a, b in spans:
        first = consecutive_start(ids[a:b])
        if first is not None:
            works.append(group.recv([rows[first : first + b - a]], 0, 0))
            continue
        if index is None or bufs is None:
            index = index_tensor(ids, rows.device)
            bufs = staging(rows, per, min(STAGING_BUFS, len(spans)))
        if len(pending) == len(bufs):
            scatter_oldest()  # before this receive is queued: it frees the buffer it reuses
        chunk = bufs[staged % len(bufs)][: b - a]
        pending.append((group.recv([chunk], 0, 0), chunk, a, b))
        staged += 1
    while pending:
        scatter_oldest()
    mark("f.recv_called")
    return works, staged


__all__ = ["STAGING_BUFS", "queue_recvs", "queue_sends", "staging"]
