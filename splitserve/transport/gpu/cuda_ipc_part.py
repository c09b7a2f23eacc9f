"""cuda_ipc between replicas of different tensor-parallel sizes: one decode rank's part of one prefill
rank's export (some of its KV heads and state channels, frames.Select) copied by our GPU straight out
of the exporter's KV, mapped into this process (cuda_ipc.py), into the rank's own blocks and fresh
state tensors (part_sink.PartTarget): no host staging, and only the part's bytes are read.

A part's fetch asks the exporter, as a whole shard's two-sided fetch does (cuda_ipc.py, step 3), over a
connection of the exporter's layout: Fetch {select} -> KvCuda {block_ids, state_row} (+ the state
tensors as the frame body when they are not in its GPU arena), with the lease pinned; then the copies,
queued on our side stream and waited for within the fetch's deadline (a copy past it hands its event
over, as a whole fetch's does); then "done", which lets the exporter unpin. The exporter counts the
part's bytes as served (the `select` it was sent). The exporter's checksum covers its
whole payload, so a part is not checked against it (as with tcp's and shm's parts).

The copies (`copy_heads`, `copy_channels`), for each pair of runs (the exporter's heads, ours): one
strided copy per run of block ids consecutive on both sides; past `COPY_RUNS_MAX` runs, a gather out of
the exporter's blocks and a scatter into ours through a device temporary of at most `STAGING_BYTES`.
State channels: one strided copy per run. They are plain tensor ops: on the CPU they do the same.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec
import numpy as np
import torch

from splitserve.transport.client import counted_failures, fetch_frame
from splitserve.transport.errors import PeerRefused, TransportError
from splitserve.transport.frames import Done, KvCuda, Runs, Select
from splitserve.transport.gpu.blocks import (
    COPY_RUNS_MAX,
    STAGING_BYTES,
    as_ids,
    check_ids,
    ids_from_wire,
    index_tensor,
    paired_runs,
)
from splitserve.transport.gpu.cuda_ipc_copy import arena_row, wait_copies
from splitserve.transport.gpu.cuda_ipc_share import PeerKV
from splitserve.transport.gpu.link import GpuSide
from splitserve.transport.gpu.state_arena import unpack
from splitserve.transport.layout import KVLayout, torch_dtype
from splitserve.transport.part_sink import PartTarget, Picks
from splitserve.transport.payload import ByteStream, check_select, empty_state, selected_nbytes, state_pieces
from splitserve.transport.protocol import Deadline, expect
from splitserve.transport.transport import FetchRequest


def kv_view(rows: torch.Tensor, layout: KVLayout) -> torch.Tensor:
    """A KV cache of `layout` seen as byte rows [num_blocks, block_nbytes] (`kv_rows`), as its tensor
    [num_blocks, L, 2, block_size, KVH, D] again (a view)."""
    return rows.view(torch_dtype(layout.dtype)).view(rows.shape[0], *layout.block_shape)


def _pairs(src: Runs, dst: Runs) -> list[tuple[int, int, int]]:
    """(source first, our first, count) of each pair of runs (the same shapes of runs, in order)."""
    if len(src) != len(dst) or any(a[1] != b[1] for a, b in zip(src, dst, strict=False)):
        raise ValueError(f"runs {list(src)} and {list(dst)} differ in shape")
    return [(s, d, n) for (s, n), (d, _) in zip(src, dst, strict=True) if n]


def copy_heads(
    src: torch.Tensor, src_ids: Sequence[int] | np.ndarray, src_heads: Runs,
    dst: torch.Tensor, dst_ids: Sequence[int] | np.ndarray, dst_heads: Runs,
    max_runs: int = COPY_RUNS_MAX, staging_bytes: int = STAGING_BYTES,
) -> str:  # fmt: skip
    """dst[dst_ids][..., each run of dst_heads, :] := src[src_ids][..., its run of src_heads, :], for KV
    caches [num_blocks, L, 2, bs, heads, D] of one dtype on any devices (each its own head count);
    enqueued on the current stream(s). -> how: "runs" (a strided copy per run of block ids
    consecutive on both sides, per pair of head runs) or "gather_scatter"."""
    pairs = _pairs(src_heads, dst_heads)
    runs = paired_runs(src_ids, dst_ids)
    if len(runs) <= max_runs:
        for s, d, k in runs:
            for hs, hd, n in pairs:
                dst[d : d + k, :, :, :, hd : hd + n].copy_(
                    src[s : s + k, :, :, :, hs : hs + n], non_blocking=True
                )
        return "runs"
    src_idx, dst_idx = index_tensor(src_ids, src.device), index_tensor(dst_ids, dst.device)
    for hs, hd, n in pairs:
        view, into = src[:, :, :, :, hs : hs + n], dst[:, :, :, :, hd : hd + n]
        per = max(1, staging_bytes // max(1, view[0].numel() * view.element_size()))
        for at in range(0, src_idx.numel(), per):
            part = view.index_select(0, src_idx[at : at + per])  # [k, L, 2, bs, n, D] on the source's device
            if part.device != dst.device:
                part = part.to(dst.device, non_blocking=True)
            into.index_copy_(0, dst_idx[at : at + per], part)
    return "gather_scatter"


def copy_channels(
    src: Mapping[str, torch.Tensor], src_picks: Picks, dst: Mapping[str, torch.Tensor], dst_picks: Picks
) -> None:
    """For each state tensor the picks name: dst's channels (its runs along the split axis) := src's
    (the source picks' runs, paired in order); one strided copy per run, on any devices."""
    if [(name, axis) for name, axis, _ in src_picks] != [(name, axis) for name, axis, _ in dst_picks]:
        raise ValueError("the source and destination picks name other state tensors")
    for (name, axis, src_runs), (_, _, dst_runs) in zip(src_picks, dst_picks, strict=True):
        for s, d, n in _pairs(src_runs, dst_runs):
            dst[name].narrow(axis, d, n).copy_(src[name].narrow(axis, s, n), non_blocking=True)


def _queue(
    mover: GpuSide, mapped: PeerKV, src_ids: np.ndarray, select: Select, target: PartTarget,
    state_row: int | None, body: Mapping[str, torch.Tensor],
) -> tuple[str, Any]:  # fmt: skip
    """Queue the part's copies on our side stream (the state out of the exporter's arena row
    `state_row`, else out of the answer's `body`); -> (how the heads moved, the CUDA event after the
    copies, or None when they were synchronous)."""
    try:
        with mover.on_device():
            wire = mapped.state_wire
            state = body if state_row is None else unpack(arena_row(mapped, state_row), mover.layout, wire)
            src = kv_view(mapped.rows, mover.layout)
            how = copy_heads(src, src_ids, select.heads, target.kv, as_ids(target.block_ids), target.heads)
            copy_channels(state, select.states, target.state, target.picks)
            if not mover.on_cuda:
                return how, None
            done = torch.cuda.Event()
            done.record()
            return how, done
    except RuntimeError as exc:  # a CUDA error
        raise TransportError(f"cuda_ipc copy of a part failed: {exc}") from exc


def read_part(mover: GpuSide, request: FetchRequest, select: Select, target: PartTarget) -> int:
    """The `select`ed heads and state channels of the handle's payload (the exporter's layout: this
    channel's) copied by our GPU into `target` (the module docstring); -> the bytes written there."""
    port, layout = mover.port, mover.layout
    handle = msgspec.structs.replace(request.handle, checksum=None)  # it covers the whole payload
    if handle.backend != "cuda_ipc":
        raise PeerRefused("handle is for another backend", [f"backend: ours cuda_ipc, peer {handle.backend}"])
    check_select(layout, select)
    into = as_ids(target.block_ids)
    check_ids(into, target.kv.shape[0], "into_block_ids")
    if into.size != handle.num_blocks:
        raise ValueError(f"the handle has {handle.num_blocks} blocks, into_block_ids has {into.size}")
    timeout_s = request.timeout_s if request.timeout_s is not None else port.options.fetch_timeout_s
    deadline, start = Deadline.after(timeout_s), time.perf_counter()
    with counted_failures(port.stats, handle.address):
        with port.pool.for_handle(handle, deadline) as chan:
            mapped: PeerKV = mover.peer(chan, handle, deadline).value
            chan.send(fetch_frame(handle, deadline, select=select), deadline)  # (its served bytes)
            header, body_nbytes = chan.recv(deadline)
            meta = expect(header, KvCuda)
            src_ids = ids_from_wire(meta.block_ids)
            if src_ids.size != into.size or src_ids.min() < 0 or src_ids.max() >= mapped.rows.shape[0]:
                raise TransportError(f"exporter named blocks outside its cache: {src_ids[:16].tolist()}")
            body: dict[str, torch.Tensor] = {}
            if meta.state_row is None:  # the state tensors are the answer's body
                body = empty_state(layout)
                stream = ByteStream(state_pieces(body, layout))
                if body_nbytes != stream.nbytes:
                    raise TransportError(
                        f"exporter sends {body_nbytes} bytes of state, we expect {stream.nbytes}"
                    )
                chan.recv_stream(stream, deadline)
            how, done = _queue(mover, mapped, src_ids, select, target, meta.state_row, body)
            wait_copies(mover, port.stats, mover.device, chan.address, deadline, done)
            deadline.remaining("copy out of the exporter's KV")  # past it the exporter may unpin
            chan.send(Done(), deadline)
    nbytes = selected_nbytes(layout, int(into.size), select)
    port.stats.fetched(nbytes, time.perf_counter() - start, handle.address)
    port.stats.count("part_fetches")
    mover.gpu_counts[f"{mapped.mode}_part_{how}"] += 1
    return nbytes


__all__ = ["copy_channels", "copy_heads", "kv_view", "read_part"]
