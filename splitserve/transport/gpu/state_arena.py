"""cuda_ipc: exported requests' recurrent state kept on the exporter's GPU and read by the fetcher's GPU.

A hybrid model's request carries, besides its KV blocks, a fixed-size state (Qwen3.5-9B: 48 MiB in
fp32). Over tcp/shm/nccl it travels through host copies on the control channel; over cuda_ipc it
would be the slowest part of the handoff that way. Instead the exporter keeps an arena

    rows  [num_rows, row_nbytes] uint8 on its GPU      one row per exported request, the state
                                                        tensors packed back to back in layout order

and shares it once per connection beside its KV (a CUDA IPC handle of the arena's storage, in the
`cuda_ipc_open` answer). `export` copies the request's state into a free row (one device copy per
state tensor) and the lease remembers the row; the fetcher copies the row out of the mapped arena
in one device copy and unpacks views. The row goes back when the lease ends, which happens only after
the fetcher's "done" (two-sided) or is seen on the lease board (one-sided), as for the blocks.

`wire_dtype` "bfloat16" halves the bytes (fp32 state is rounded once, at export; off by default:
the tokens may change). A full arena (more live leases with state than rows) sends the state the
host way, on the control channel, so nothing is refused.
"""

from __future__ import annotations

import math
import os
import threading
import weakref
from collections.abc import Mapping

import torch

from splitserve.transport.errors import TransportError
from splitserve.transport.frames import ArenaShare
from splitserve.transport.gpu.cuda_ipc_share import ipc_storage, open_ipc_storage
from splitserve.transport.layout import KVLayout, torch_dtype

WIRE_DTYPES = ("float32", "bfloat16")
# NOTE: a process-wide fact, as cuda_ipc's _LOCAL: arenas this process shares, for same-process fetchers
_LOCAL: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def _wire(dtype: str, wire_dtype: str) -> torch.dtype:
    """The dtype a state tensor travels in: bf16 only replaces fp32."""
    t = torch_dtype(dtype)
    return torch.bfloat16 if wire_dtype == "bfloat16" and t == torch.float32 else t


def row_spans(layout: KVLayout, wire_dtype: str) -> list[tuple[str, tuple[int, ...], torch.dtype, int, int]]:
    """(name, shape, wire dtype, byte offset, nbytes) of each state tensor in an arena row; offsets
    16-byte aligned."""
    spans, at = [], 0
    for name, shape, dtype in layout.state_shapes:
        wire = _wire(dtype, wire_dtype)
        nbytes = math.prod(shape) * wire.itemsize
        spans.append((name, tuple(shape), wire, at, nbytes))
        at += -(-nbytes // 16) * 16
    return spans


def unpack(row: torch.Tensor, layout: KVLayout, wire_dtype: str) -> dict[str, torch.Tensor]:
    """Views of one arena row [row_nbytes] as the layout's state tensors (converted back to the
    layout's dtype when they travelled in bf16: then copies)."""
    out = {}
    for (name, shape, wire, at, nbytes), (_, _, dtype) in zip(
        row_spans(layout, wire_dtype), layout.state_shapes, strict=True
    ):
        t = row[at : at + nbytes].view(wire).view(shape)
        out[name] = t if wire == torch_dtype(dtype) else t.to(torch_dtype(dtype))
    return out


class StateArena:
    """Exporter side: rows of packed state on the KV's device, handed out per export."""

    def __init__(self, layout: KVLayout, device: torch.device, num_rows: int, wire_dtype: str) -> None:
        if wire_dtype not in WIRE_DTYPES:
            raise ValueError(f"state wire dtype must be one of {WIRE_DTYPES}, not {wire_dtype!r}")
        self.layout, self.wire_dtype = layout, wire_dtype
        spans = row_spans(layout, wire_dtype)
        self.row_nbytes = -(-(spans[-1][3] + spans[-1][4]) // 256) * 256 if spans else 0
        self.rows = torch.zeros((num_rows, self.row_nbytes), dtype=torch.uint8, device=device)
        self.key = f"{os.getpid()}-state-{id(self):x}"
        self._free = list(range(num_rows - 1, -1, -1))
        self._lock = threading.Lock()
        _LOCAL[self.key] = self.rows

    @property
    def num_free(self) -> int:
        return len(self._free)

    def put(self, state: Mapping[str, torch.Tensor]) -> int | None:
        """Copy `state` (the layout's tensors, any device) into a free row; -> the row, or None when
        the arena is full. The copies are queued on the current stream (the caller synchronizes)."""
        with self._lock:
            if not self._free:
                return None
            row = self._free.pop()
        for name, shape, wire, at, nbytes in row_spans(self.layout, self.wire_dtype):
            src = state[name]
            if tuple(src.shape) != shape:
                self.free(row)
                raise ValueError(f"state {name!r}: got {tuple(src.shape)}, layout says {shape}")
            self.rows[row, at : at + nbytes].view(wire).view(shape).copy_(src, non_blocking=True)
        return row

    def free(self, row: int) -> None:
        with self._lock:
            assert row not in self._free, f"state arena row {row} freed twice"
            self._free.append(row)

    def share(self) -> ArenaShare:
        """The arena as a share (a CUDA IPC handle of its storage on CUDA)."""
        rows = self.rows
        storage = ipc_storage(rows) if rows.is_cuda else {}
        return ArenaShare(key=self.key, pid=os.getpid(), rows=rows.shape[0], row_nbytes=self.row_nbytes,
                          wire_dtype=self.wire_dtype, offset=rows.storage_offset(), **storage)  # fmt: skip


def open_arena(share: ArenaShare, device_index: int | None) -> torch.Tensor:
    """Fetcher side: the exporter's arena rows [rows, row_nbytes], mapped on GPU `device_index` (the
    device the peer's KV was opened on), or the tensor itself for a same-process exporter."""
    shape = (share.rows, share.row_nbytes)
    if share.pid == os.getpid():
        rows = _LOCAL.get(share.key)
        if rows is None:
            raise TransportError("exporter in this process no longer holds the state arena it shared")
        return rows
    if share.handle is None or device_index is None:
        raise TransportError("cuda_ipc: the exporter's state arena is not on a GPU")
    try:
        storage = open_ipc_storage(share, device_index)
    except RuntimeError as exc:
        raise TransportError(f"cuda_ipc: cannot open the exporter's state arena: {exc}") from exc
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, share.offset, shape, (shape[1], 1))
    return flat
