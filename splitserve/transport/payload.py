"""The bytes of one transfer: the request's blocks in handle order, then its state tensors in layout order.

Neither side builds that payload as one buffer. On CPU a `ByteStream` is a list of zero-copy uint8
views: each run of consecutive block ids is one contiguous slice of the block-major KV tensor
(`kv[start:start + n]`), each state tensor one more slice. The exporter's socket sends straight from
those views (scatter-gather `sendmsg`) and the fetcher's receives straight into its own blocks
(`recvmsg_into`): no staging copy on either side. Where the KV is not on the host (GPU later) the
blocks are staged through one host buffer instead: `kv[block_ids].cpu()` out, `kv[ids] = staged` in.

NOTE: a fetch writes the destination blocks before the checksum is verified; on any error their
content is undefined and the caller frees them (or recomputes).
"""

from __future__ import annotations

import bisect
import math
import os
from collections.abc import Iterator, Mapping, Sequence

import numpy as np
import torch

from splitserve.transport.errors import TransportError
from splitserve.transport.frames import Select
from splitserve.transport.layout import KVLayout, itemsize, torch_dtype

IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024
WINDOW_BYTES = 8 << 20  # one sendmsg / recvmsg_into call is offered this much (> socket buffers)


class ByteStream:
    """Flat uint8 arrays read or written as one run of bytes."""

    def __init__(self, pieces: Sequence[np.ndarray]) -> None:
        self.pieces = [p for p in pieces if p.nbytes]
        self.starts = [0]
        for piece in self.pieces:
            self.starts.append(self.starts[-1] + piece.nbytes)
        self.nbytes = self.starts[-1]

    def segments(self, pos: int, nbytes: int) -> Iterator[np.ndarray]:
        """Views of stream[pos : pos + nbytes], piece by piece."""
        end = min(pos + nbytes, self.nbytes)
        i = bisect.bisect_right(self.starts, pos) - 1
        while pos < end:
            lo = pos - self.starts[i]
            hi = min(end - self.starts[i], self.pieces[i].nbytes)
            yield self.pieces[i][lo:hi]
            pos += hi - lo
            i += 1

    def window(self, pos: int, max_bytes: int = WINDOW_BYTES) -> list[np.ndarray]:
        """At most IOV_MAX views from `pos` on: one sendmsg / recvmsg_into call's worth."""
        i = bisect.bisect_right(self.starts, pos) - 1
        if pos == self.starts[i]:  # at a piece's start (every window of a receive): whole pieces
            j = min(i + IOV_MAX, len(self.pieces))
            while j > i + 1 and self.starts[j] - pos > max_bytes:
                j = i + 1 + (j - i - 1) // 2
            if self.starts[j] - pos <= max_bytes:
                return self.pieces[i:j]
        out = []
        for seg in self.segments(pos, max_bytes):
            out.append(seg)
            if len(out) == IOV_MAX:
                break
        return out

    def sub(self, pos: int, nbytes: int) -> ByteStream:
        """stream[pos : pos + nbytes] as a stream of its own (views, no copy)."""
        return ByteStream(list(self.segments(pos, nbytes)))

    def copy_stream(self, src: ByteStream, pos: int = 0) -> None:
        """src -> stream[pos : pos + src.nbytes], one memcpy per overlap of their pieces."""
        for piece in src.pieces:
            self.copy_from(pos, piece)
            pos += piece.nbytes

    def copy_to(self, pos: int, dst: np.ndarray) -> None:
        """stream[pos : pos + len(dst)] -> dst."""
        at = 0
        for seg in self.segments(pos, dst.nbytes):
            np.copyto(dst[at : at + seg.nbytes], seg)
            at += seg.nbytes

    def copy_from(self, pos: int, src: np.ndarray) -> None:
        """src -> stream[pos : pos + len(src)]."""
        at = 0
        for seg in self.segments(pos, src.nbytes):
            np.copyto(seg, src[at : at + seg.nbytes])
            at += seg.nbytes


def tensor_bytes(t: torch.Tensor) -> np.ndarray:
    """A flat uint8 view of a contiguous CPU tensor (no copy; works for bfloat16 too)."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("need a contiguous CPU tensor to view its bytes")
    return t.detach().reshape(-1).view(torch.uint8).numpy()


def block_runs(block_ids: Sequence[int]) -> list[tuple[int, int]]:
    """[5, 6, 7, 2, 3] -> [(5, 3), (2, 2)]: (first block, count) for each run of consecutive ids."""
    runs: list[tuple[int, int]] = []
    for b in block_ids:
        if runs and runs[-1][0] + runs[-1][1] == b:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((b, 1))
    return runs


def direct_access(kv: torch.Tensor) -> bool:
    return kv.device.type == "cpu" and kv.is_contiguous()


def _staged(kv: torch.Tensor, stage: bool | None) -> bool:
    return not direct_access(kv) if stage is None else stage


def block_pieces(kv: torch.Tensor, block_ids: Sequence[int]) -> list[np.ndarray]:
    """Zero-copy views of kv[block_ids] (CPU, contiguous kv), one per run of consecutive ids."""
    rows = tensor_bytes(kv).reshape(kv.shape[0], -1)  # [num_blocks, block_nbytes]
    return [rows[start : start + n].reshape(-1) for start, n in block_runs(block_ids)]


def source_pieces(kv: torch.Tensor, block_ids: Sequence[int], stage: bool | None = None) -> list[np.ndarray]:
    """What the exporter sends for these blocks: views of kv, or one staged host copy."""
    if _staged(kv, stage):
        staged = kv[torch.as_tensor(block_ids, device=kv.device)].contiguous().cpu()  # [n, L, 2, bs, H, D]
        return [tensor_bytes(staged)]
    return block_pieces(kv, block_ids)


class BlockSink:
    """Where the fetcher receives blocks: its own kv[into_block_ids], or a host buffer + `commit`."""

    def __init__(self, kv: torch.Tensor, block_ids: Sequence[int], stage: bool | None = None) -> None:
        self.kv_cache = kv
        self.block_ids = list(block_ids)
        self.staged: torch.Tensor | None = None
        if _staged(kv, stage):
            shape = (len(self.block_ids), *kv.shape[1:])  # [n, L, 2, bs, H, D]
            self.staged = torch.empty(shape, dtype=kv.dtype, pin_memory=kv.device.type == "cuda")
            self.pieces = [tensor_bytes(self.staged)]
        else:
            self.pieces = block_pieces(kv, self.block_ids)

    def commit(self) -> None:
        if self.staged is not None:
            index = torch.as_tensor(self.block_ids, device=self.kv_cache.device)
            self.kv_cache[index] = self.staged.to(self.kv_cache.device)


def check_state(layout: KVLayout, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """The request's state tensors, checked against the layout (names, shapes, dtypes)."""
    state = dict(state or {})
    expected = [name for name, _, _ in layout.state_shapes]
    if sorted(state) != sorted(expected):
        raise ValueError(f"state tensors {sorted(state)} do not match the layout's {sorted(expected)}")
    for name, shape, dtype in layout.state_shapes:
        t = state[name]
        if tuple(t.shape) != tuple(shape) or t.dtype != torch_dtype(dtype):
            raise ValueError(f"state {name!r}: got {tuple(t.shape)} {t.dtype}, layout says {shape} {dtype}")
    return state


def snapshot_state(layout: KVLayout, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
    """Host copies of the request's state tensors, checked against the layout (they are small, and a
    copy lets the engine reuse its state slot at once)."""
    state = check_state(layout, state)
    names = [name for name, _, _ in layout.state_shapes]
    return {name: state[name].detach().to("cpu", copy=True).contiguous() for name in names}


def empty_state(layout: KVLayout) -> dict[str, torch.Tensor]:
    return {name: torch.empty(shape, dtype=torch_dtype(dtype)) for name, shape, dtype in layout.state_shapes}


def state_pieces(state: Mapping[str, torch.Tensor], layout: KVLayout) -> list[np.ndarray]:
    return [tensor_bytes(state[name]) for name, _, _ in layout.state_shapes]


def host_state_pieces(state: Mapping[str, torch.Tensor], layout: KVLayout) -> list[np.ndarray]:
    """state_pieces of tensors that may live on a device (copied to the host first: checksums)."""
    return [tensor_bytes(state[name].detach().cpu().contiguous()) for name, _, _ in layout.state_shapes]


# -- part of a payload: some KV heads and state channels (frames.Select) ----------------------------
def run_views(rows: np.ndarray, runs: Sequence[tuple[int, int]], unit: int) -> list[np.ndarray]:
    """rows: [R, C] bytes; -> for each row, the columns of each run (units of `unit` bytes), in order:
    one zero-copy view each. A run covering whole rows stays one view."""
    if len(runs) == 1 and runs[0] == (0, rows.shape[1] // unit):
        return [rows.reshape(-1)]
    cols = [list(rows[:, first * unit : (first + n) * unit]) for first, n in runs if n]  # rows, in C
    return cols[0] if len(cols) == 1 else [piece for row in zip(*cols, strict=True) for piece in row]


def head_pieces(
    rows: np.ndarray, layout: KVLayout, block_ids: Sequence[int], heads: Sequence[tuple[int, int]]
) -> list[np.ndarray]:
    """The `heads` runs of kv[block_ids], with `rows` the cache's bytes [num_blocks, block_nbytes] of
    `layout`: block by block, for each (layer, k/v, position) row of a block, each run in order."""
    unit = layout.head_dim * itemsize(layout.dtype)  # one head's bytes in a row
    width = layout.num_kv_heads * unit
    out: list[np.ndarray] = []
    for start, n in block_runs(block_ids):
        out += run_views(rows[start : start + n].reshape(-1, width), heads, unit)  # [n * L * 2 * bs, H * D]
    return out


def channel_pieces(
    state: Mapping[str, torch.Tensor], picks: Sequence[tuple[str, int, Sequence[tuple[int, int]]]]
) -> list[np.ndarray]:
    """For each (name, axis, runs): the runs of state[name] along `axis`, for each index of the axes
    before it, in order (contiguous CPU tensors; views)."""
    out: list[np.ndarray] = []
    for name, axis, runs in picks:
        t = state[name]
        unit = math.prod(t.shape[axis + 1 :]) * t.element_size()
        out += run_views(tensor_bytes(t).reshape(math.prod(t.shape[:axis]), -1), runs, unit)
    return out


def selected_pieces(
    kv: torch.Tensor, layout: KVLayout, block_ids: Sequence[int], state: Mapping[str, torch.Tensor],
    select: Select,
) -> list[np.ndarray]:  # fmt: skip
    """What the exporter sends for a fetch that selects part of the payload, in `head_pieces` and
    `channel_pieces` order: the selected heads of the blocks, then the selected state channels,
    each gathered into one host tensor (a strided part would otherwise take an iovec per row)."""
    check_select(layout, select)
    ids = torch.as_tensor(list(block_ids), device=kv.device)
    heads = _positions(select.heads, kv.device)
    blocks = kv.index_select(0, ids).index_select(4, heads).cpu()  # [n, L, 2, bs, selected heads, D]
    out = [tensor_bytes(blocks)]
    for name, axis, runs in select.states:
        t = state[name]
        out.append(tensor_bytes(t.index_select(axis, _positions(runs, t.device)).cpu().contiguous()))
    return out


def _positions(runs: Sequence[tuple[int, int]], device: torch.device) -> torch.Tensor:
    return torch.as_tensor([i for first, n in runs for i in range(first, first + n)], device=device)


def selected_nbytes(layout: KVLayout, num_blocks: int, select: Select | None) -> int:
    """The bytes of a payload of `num_blocks` blocks (the part `select` picks, when given)."""
    if select is None:
        return layout.payload_nbytes(num_blocks)
    row_heads = sum(n for _, n in select.heads) * layout.head_dim * itemsize(layout.dtype)
    total = num_blocks * layout.num_layers * 2 * layout.block_size * row_heads
    shapes = {name: (shape, dtype) for name, shape, dtype in layout.state_shapes}
    for name, axis, runs in select.states:
        shape, dtype = shapes[name]
        total += math.prod(shape) // max(1, shape[axis]) * sum(n for _, n in runs) * itemsize(dtype)
    return total


def check_select(layout: KVLayout, select: Select) -> None:
    """TransportError when `select` names heads or channels `layout` does not have."""
    shapes = {name: shape for name, shape, _ in layout.state_shapes}
    bad = [f"heads {r}" for r in select.heads if not _fits(r, layout.num_kv_heads)]
    for name, axis, runs in select.states:
        shape = shapes.get(name)
        if shape is None or not 0 <= axis < len(shape):
            bad.append(f"state {name!r} axis {axis}")
        else:
            bad += [f"state {name!r} channels {r}" for r in runs if not _fits(r, shape[axis])]
    if bad:
        raise TransportError(f"the fetch selects what the exporter's layout lacks: {', '.join(bad[:4])}")


def _fits(run: tuple[int, int], count: int) -> bool:
    first, n = run
    return 0 <= first and 0 <= n and first + n <= count
