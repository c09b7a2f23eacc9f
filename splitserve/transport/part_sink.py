"""Where a tensor-parallel rank receives one part of a transfer: some KV heads of its blocks and some
channels of its state tensors, on the host or on a CUDA device.

The exporter sends a part (frames.Select) packed: the selected heads of the request's blocks
[n, L, 2, block_size, heads picked, D] in block-id order, then each picked state's selected channels
(payload.selected_pieces). The receiver's `heads` and `picks` say where each run of those lands in its
own tensors (engine/tp/kv_routes.Part: the same shapes of runs, in the same order).

    sink = PartSink(kv, layout, into_block_ids, part.heads, state, part.states)
    channel.fetch_part(request, part.select, ByteStream(sink.pieces))
    sink.commit()

A part that fills whole rows of a host cache (every head this rank holds) is received straight into
the blocks' bytes. Any other part (a few heads of each row, or a device cache) is received into one
host buffer, pinned for a CUDA cache, and `commit` places it with one strided copy per run of heads
(`index_copy_` over the block ids): a handful of tensor ops, however many rows the blocks have.
State channels go the same two ways. Nothing is written into `kv` or `state` before `commit` except
by the direct views.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from splitserve.transport.frames import Runs
from splitserve.transport.layout import KVLayout, torch_dtype
from splitserve.transport.payload import block_pieces, direct_access, tensor_bytes

Picks = Sequence[tuple[str, int, Runs]]  # (state name, split axis, runs along it), in payload order


class PartTarget(NamedTuple):
    """Where one part of a transfer lands: a rank's KV cache [num_blocks, L, 2, bs, KVH, D] of
    `layout`, its blocks `block_ids` (handle order), the runs of its heads the part's head runs fill
    (`heads`), its fresh state tensors by name and the runs of their channels the part fills (`picks`).
    `PartSink(*target)` receives a streamed part into it; cuda_ipc copies into it on the device."""

    kv: torch.Tensor
    layout: KVLayout
    block_ids: Sequence[int]
    heads: Runs
    state: Mapping[str, torch.Tensor]
    picks: Picks


def _count(runs: Runs) -> int:
    return sum(n for _, n in runs)


def _whole(runs: Runs, size: int) -> bool:
    return [(f, n) for f, n in runs if n] == [(0, size)]


def _buffer(shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    return torch.empty(tuple(shape), dtype=dtype, pin_memory=device.type == "cuda")


class PartSink:
    """The receive side of one part, over a rank's KV cache [num_blocks, L, 2, bs, KVH, D] and its fresh
    state tensors for the request (`state`, by name; any device)."""

    def __init__(
        self,
        kv: torch.Tensor,
        layout: KVLayout,
        block_ids: Sequence[int],
        heads: Runs,
        state: Mapping[str, torch.Tensor],
        picks: Picks,
    ) -> None:
        self.pieces: list[np.ndarray] = []
        self._commits: list[Callable[[], None]] = []
        ids = list(block_ids)
        if _count(heads):
            if direct_access(kv) and _whole(heads, layout.num_kv_heads):
                self.pieces += block_pieces(kv, ids)
            else:
                shape = (len(ids), *kv.shape[1:4], _count(heads), kv.shape[5])  # [n, L, 2, bs, h, D]
                staged = _buffer(shape, torch_dtype(layout.dtype), kv.device)
                self.pieces.append(tensor_bytes(staged))
                self._commits.append(partial(place_heads, kv, ids, heads, staged))
        for name, axis, runs in picks:
            t = state[name]
            if not _count(runs):
                continue
            if direct_access(t) and _whole(runs, t.shape[axis]):
                self.pieces.append(tensor_bytes(t))
                continue
            shape = list(t.shape)
            shape[axis] = _count(runs)
            staged = _buffer(shape, t.dtype, t.device)
            self.pieces.append(tensor_bytes(staged))
            self._commits.append(partial(place_channels, t, axis, runs, staged))
        self.nbytes = sum(p.nbytes for p in self.pieces)

    def commit(self) -> None:
        """Place what was received into a host buffer (after the payload arrived whole)."""
        for place in self._commits:
            place()
        self._commits = []


def place_heads(kv: torch.Tensor, block_ids: Sequence[int], heads: Runs, src: torch.Tensor) -> None:
    """kv[block_ids][..., run, :] := src[..., run's share, :] for each run of `heads` in order.
    kv [num_blocks, L, 2, bs, KVH, D] on any device; src [n, L, 2, bs, h, D] (h the runs' total)."""
    src = src.to(kv.device, non_blocking=True)
    ids = torch.as_tensor(list(block_ids), dtype=torch.int64, device=kv.device)
    at = 0
    for first, n in heads:
        if n:
            kv[:, :, :, :, first : first + n].index_copy_(0, ids, src[:, :, :, :, at : at + n])
        at += n


def place_channels(t: torch.Tensor, axis: int, runs: Runs, src: torch.Tensor) -> None:
    """t's channels `runs` along `axis` := src's (the runs' channels packed in order, same other dims)."""
    src = src.to(t.device, non_blocking=True)
    at = 0
    for first, n in runs:
        if n:
            t.narrow(axis, first, n).copy_(src.narrow(axis, at, n))
        at += n


__all__ = ["PartSink", "PartTarget", "Picks", "place_channels", "place_heads"]
