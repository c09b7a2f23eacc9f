"""cuda_ipc's open exchange: the exporter's KV storage as a CUDA IPC share (`share_kv`, the frame
`CudaIpcShare`) and the fetcher's mapping of it (`open_peer` -> `PeerKV`), with its lease board
(`open_board`). cuda_ipc.py tells the life of a connection."""

from __future__ import annotations

import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.transport.board import BoardView
from splitserve.transport.errors import BackendUnavailable, PeerRefused, TransportError
from splitserve.transport.frames import ArenaShare, BoardShare, CudaIpcShare, IpcStorage
from splitserve.transport.gpu.blocks import gpu_uuid, host_id, local_gpu
from splitserve.transport.layout import KVLayout
from splitserve.wire.transport_info import PeerInfo

log = logging.getLogger(__name__)

# -- the exporter's KV as a JSON-able share; the fetcher's view of it ------------------------------
# NOTE: a process-wide fact, not configuration: KV caches this process exports, by share key, so that
# a fetcher in the same process (CUDA cannot open its own IPC handle) can read them directly.
_LOCAL: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def ipc_storage(tensor: torch.Tensor) -> dict[str, bytes | int]:
    """The CUDA IPC handle of `tensor`'s storage, as the fields of frames.py's `IpcStorage`."""
    (_dev, handle, size, offset, ref_counter, ref_offset, _event, _sync) = (
        tensor.untyped_storage()._share_cuda_()
    )
    return {"handle": handle, "storage_nbytes": int(size), "storage_offset": int(offset),
            "ref_counter": ref_counter, "ref_counter_offset": int(ref_offset)}  # fmt: skip


def open_ipc_storage(share: IpcStorage, device_index: int) -> torch.UntypedStorage:
    """The fetcher's mapping of a shared storage on GPU `device_index` (RuntimeError if CUDA refuses)."""
    assert share.handle is not None
    args = (share.handle, share.storage_nbytes, share.storage_offset, share.ref_counter,
            share.ref_counter_offset, b"", False)  # fmt: skip
    return torch.UntypedStorage._new_shared_cuda(device_index, *args)


def share_kv(
    kv: torch.Tensor, rows: torch.Tensor, key: str, board: BoardShare | None, state: ArenaShare | None
) -> CudaIpcShare:
    """The exporter's half of the open exchange: its KV storage as a CUDA IPC handle (once per key),
    with its lease board and state arena.

    `rows` is `kv_rows(kv)` held by the exporter: same-process fetchers find it under `key` while it
    lives."""
    _LOCAL[key] = rows
    storage: dict[str, Any] = {}
    if kv.device.type == "cuda":
        try:
            storage = ipc_storage(kv)
        except RuntimeError as exc:
            raise BackendUnavailable(
                f"cuda_ipc: cannot share this KV allocation over CUDA IPC: {exc}"
            ) from exc
    return CudaIpcShare(
        key=key, host=host_id(), pid=os.getpid(), gpu=gpu_uuid(kv.device),
        kv_offset=kv.storage_offset() * kv.element_size(), kv_nbytes=rows.numel(), block_nbytes=rows.shape[1],
        board=board, state=state, **storage,
    )  # fmt: skip


@dataclass
class PeerKV:
    """Fetcher side: one exporter's KV cache as byte rows on some device of ours."""

    rows: torch.Tensor  # [num_blocks, block_nbytes] uint8
    mode: str  # "p2p" | "staged" | "local"
    gpu: str  # the exporter's GPU UUID
    board: BoardView | None = None  # the exporter's lease board: one-sided fetches (board.py)
    layout_fingerprint: str = ""  # the exporter's layout, from the handshake
    state_rows: torch.Tensor | None = None  # the exporter's state arena [rows, row_nbytes] (state_arena.py)
    state_wire: str = "float32"

    def describe(self) -> PeerInfo:
        return PeerInfo(self.mode, self.gpu, str(self.rows.device), self.board is not None)


def open_peer(share: CudaIpcShare, dst: torch.device, layout: KVLayout) -> PeerKV:
    """Open the exporter's share (answer of cuda_ipc_open) for copies into our KV on `dst`."""
    if share.host != host_id():
        raise PeerRefused("cuda_ipc needs both workers on one host",
                          [f"host: ours {host_id()}, peer {share.host}"])  # fmt: skip
    block_nbytes, kv_nbytes = share.block_nbytes, share.kv_nbytes
    if block_nbytes != layout.block_nbytes or kv_nbytes <= 0 or kv_nbytes % block_nbytes:
        raise TransportError(f"exporter shares {kv_nbytes} bytes in blocks of {block_nbytes}; "
                             f"our layout's blocks are {layout.block_nbytes} bytes")  # fmt: skip
    gpu = share.gpu
    if share.pid == os.getpid():
        rows = _LOCAL.get(share.key)
        if rows is None:
            raise TransportError("exporter in this process no longer holds the KV it shared")
        return PeerKV(rows, "local", gpu)
    if share.handle is None or dst.type != "cuda":
        raise PeerRefused("cuda_ipc moves GPU KV between GPU workers", [f"gpu: ours {dst}, peer {gpu}"])
    src_index = local_gpu(gpu)
    if src_index is None:
        raise PeerRefused(
            "cuda_ipc: the exporter's GPU is not visible to this process",
            [f"gpu: peer {gpu}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"],
        )
    assert dst.index is not None
    p2p = src_index == dst.index or torch.cuda.can_device_access_peer(dst.index, src_index)
    storage, mode = None, "p2p"
    if p2p:  # map the exporter's memory into our own GPU's address space (peer access enabled lazily)
        try:
            storage = open_ipc_storage(share, dst.index)
        except RuntimeError as exc:
            log.warning("cuda_ipc: opening %s's KV on %s failed (%s); copying across devices instead",
                        gpu, dst, exc)  # fmt: skip
    if storage is None:
        mode = "staged" if src_index != dst.index else "p2p"
        try:
            storage = open_ipc_storage(share, src_index)
        except RuntimeError as exc:
            raise TransportError(f"cuda_ipc: cannot open the exporter's KV handle: {exc}") from exc
    offset = share.kv_offset
    if offset + kv_nbytes > storage.nbytes():
        raise TransportError(f"exporter's KV ({offset}+{kv_nbytes} bytes) lies outside its shared storage")
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, offset, (kv_nbytes // block_nbytes, block_nbytes), (block_nbytes, 1))
    return PeerKV(flat, mode, gpu)


def open_board(share: BoardShare | None, address: str) -> BoardView | None:
    """The fetcher's map of an exporter's lease board (the `board` of its share), or None: without
    one every fetch asks first (counted as such in describe()); no error, nothing is lost."""
    if share is None:
        return None
    try:
        return BoardView(share.path, share.slots)
    except (OSError, ValueError) as exc:
        log.warning("cuda_ipc: cannot map the lease board of %s (%s): its fetches ask first", address, exc)
        return None
