"""The device copies of a cuda_ipc fetch (cuda_ipc.py): blocks, and a state arena row, out of the
exporter's KV mapped into this process, queued on our side stream, and the wait for them within the
fetch's deadline, so that a copy that never ends cannot hang the fetch.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splitserve.transport.errors import TransferTimeout, TransportError
from splitserve.transport.gpu.blocks import copy_blocks, wait_event
from splitserve.transport.gpu.cuda_ipc_share import PeerKV
from splitserve.transport.gpu.link import GpuSide
from splitserve.transport.gpu.state_arena import unpack
from splitserve.transport.layout import KVLayout
from splitserve.transport.protocol import Deadline
from splitserve.transport.trace import gpu_mark
from splitserve.transport.transport import TransportStats


def queue_copy(
    mover: GpuSide, mapped: PeerKV, rows: torch.Tensor, src_ids: np.ndarray, into: np.ndarray
) -> tuple[str, Any]:
    """Queue the copy of the exporter's blocks `src_ids` into our `into` on our side stream; -> (how it
    was done, the CUDA event after it or None when it was synchronous)."""
    try:
        with mover.on_device():
            gpu_mark("f.copy_start", rows.device)
            how = copy_blocks(mapped.rows, rows, src_ids, into)
            gpu_mark("f.copy_end", rows.device)
            if not mover.on_cuda:
                return how, None
            done = torch.cuda.Event()
            done.record()
            return how, done
    except RuntimeError as exc:  # a CUDA error
        raise TransportError(f"cuda_ipc copy failed: {exc}") from exc


def arena_row(mapped: PeerKV, row: int) -> torch.Tensor:
    """Our mapping of the exporter's GPU state arena row `row` (uint8); TransportError when the arena
    is not mapped or the row is outside it."""
    if mapped.state_rows is None:
        raise TransportError(
            "cuda_ipc: the exporter keeps the state in its GPU arena, which we could not map "
            "(see the log); set transport.state_rows: 0 to send the state the host way"
        )
    if not 0 <= row < mapped.state_rows.shape[0]:
        raise TransportError(f"exporter named state arena row {row}, outside its arena")
    return mapped.state_rows[row]


def queue_state_copy(
    mover: GpuSide, mapped: PeerKV, row: int, layout: KVLayout, device: torch.device
) -> tuple[dict[str, torch.Tensor], Any]:
    """One device copy of the exporter's arena row into a buffer on our GPU; -> (the state tensors,
    views of it or fp32 copies when it travelled in bf16; the CUDA event after the copy or None)."""
    src = arena_row(mapped, row)
    try:
        with mover.on_device():
            buf = torch.empty(src.shape[0], dtype=torch.uint8, device=device)
            buf.copy_(src, non_blocking=True)
            state = unpack(buf, layout, mapped.state_wire)
            done = None
            if mover.on_cuda:
                done = torch.cuda.Event()
                done.record()
            return state, done
    except torch.cuda.OutOfMemoryError as exc:
        raise TransportError(
            f"cuda_ipc: no room on this GPU for a {mapped.state_rows.shape[1] >> 20} MiB state row: "
            "lower engine.memory_utilization (the workers' shares on one GPU should leave room for "
            "the transport) or give engine.kv_cache_mb"
        ) from exc
    except RuntimeError as exc:  # a CUDA error
        raise TransportError(f"cuda_ipc state copy failed: {exc}") from exc


def wait_copies(
    mover: GpuSide, stats: TransportStats, device: torch.device, address: str, deadline: Deadline,
    done: Any,
) -> None:  # fmt: skip
    """Wait for a fetch's copies (`done`: the CUDA event after them; None: they were synchronous) until
    the fetch's deadline, polling (`wait_event`). Past the deadline: TransferTimeout carrying the copy's
    event (`pending`: the blocks stay out of use until it has happened). A CUDA error is the transfer's."""
    if done is None:
        return
    try:
        with torch.cuda.device(device):
            wait_event(done, deadline, f"cuda_ipc copy from {address}")
    except TransferTimeout as exc:  # (a RuntimeError too: before the clause for CUDA's errors)
        stats.count("copy_deadline_missed")
        mover.hand_over(exc, done)
        raise
    except RuntimeError as exc:
        raise TransportError(f"cuda_ipc copy from {address} failed: {exc}") from exc


__all__ = ["arena_row", "queue_copy", "queue_state_copy", "wait_copies"]
