"""cuda_ipc's open exchange: the exporter's KV storage as a JSON-able CUDA IPC share (`share_kv`) and the
fetcher's mapping of it (`open_peer` -> `PeerKV`), with its lease board (`open_board`). cuda_ipc.py tells
the life of a connection."""

from __future__ import annotations

import base64
import logging
import os
import weakref
from dataclasses import dataclass
from typing import Any

import torch

from splitserve.transport.board import BoardView
from splitserve.transport.errors import BackendUnavailable, PeerRefused, TransportError
from splitserve.transport.gpu.blocks import gpu_uuid, host_id, local_gpu
from splitserve.transport.layout import KVLayout

log = logging.getLogger(__name__)

# -- the exporter's KV as a JSON-able share; the fetcher's view of it ------------------------------
# NOTE: a process-wide fact, not configuration: KV caches this process exports, by share key, so that
# a fetcher in the same process (CUDA cannot open its own IPC handle) can read them directly.
_LOCAL: weakref.WeakValueDictionary[str, torch.Tensor] = weakref.WeakValueDictionary()


def _b64(data: bytes | None) -> str | None:
    return None if data is None else base64.b64encode(data).decode()


def _unb64(text: object) -> bytes:
    if not isinstance(text, str):
        raise TransportError(f"exporter sent a malformed IPC handle field: {text!r}")
    return base64.b64decode(text.encode(), validate=True)


def share_kv(kv: torch.Tensor, rows: torch.Tensor, key: str) -> dict:
    """The exporter's half of the open exchange: its KV storage as a CUDA IPC handle (once per key).

    `rows` is `kv_rows(kv)` held by the exporter: same-process fetchers find it under `key` while it
    lives."""
    _LOCAL[key] = rows
    share: dict[str, Any] = {
        "key": key,
        "host": host_id(),
        "pid": os.getpid(),
        "gpu": gpu_uuid(kv.device),
        "kv_offset": kv.storage_offset() * kv.element_size(),
        "kv_nbytes": rows.numel(),
        "block_nbytes": rows.shape[1],
        "handle": None,
    }
    if kv.device.type == "cuda":
        try:
            (_dev, handle, size, offset, ref_counter, ref_offset, _event, _sync) = (
                kv.untyped_storage()._share_cuda_()
            )
        except RuntimeError as exc:
            raise BackendUnavailable(
                f"cuda_ipc: cannot share this KV allocation over CUDA IPC: {exc}"
            ) from exc
        share.update(handle=_b64(handle), storage_nbytes=int(size), storage_offset=int(offset),
                     ref_counter=_b64(ref_counter), ref_counter_offset=int(ref_offset))  # fmt: skip
    return share


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

    def describe(self) -> dict:
        return {"mode": self.mode, "gpu": self.gpu, "device": str(self.rows.device),
                "one_sided": self.board is not None}  # fmt: skip


def open_peer(share: dict, dst: torch.device, layout: KVLayout) -> PeerKV:
    """Open the exporter's share (answer of cuda_ipc_open) for copies into our KV on `dst`."""
    if share.get("host") != host_id():
        raise PeerRefused("cuda_ipc needs both workers on one host",
                          [f"host: ours {host_id()}, peer {share.get('host')}"])  # fmt: skip
    block_nbytes, kv_nbytes = int(share["block_nbytes"]), int(share["kv_nbytes"])
    if block_nbytes != layout.block_nbytes or kv_nbytes <= 0 or kv_nbytes % block_nbytes:
        raise TransportError(f"exporter shares {kv_nbytes} bytes in blocks of {block_nbytes}; "
                             f"our layout's blocks are {layout.block_nbytes} bytes")  # fmt: skip
    gpu = str(share["gpu"])
    if int(share["pid"]) == os.getpid():
        rows = _LOCAL.get(str(share["key"]))
        if rows is None:
            raise TransportError("exporter in this process no longer holds the KV it shared")
        return PeerKV(rows, "local", gpu)
    if share.get("handle") is None or dst.type != "cuda":
        raise PeerRefused("cuda_ipc moves GPU KV between GPU workers", [f"gpu: ours {dst}, peer {gpu}"])
    src_index = local_gpu(gpu)
    if src_index is None:
        raise PeerRefused(
            "cuda_ipc: the exporter's GPU is not visible to this process",
            [f"gpu: peer {gpu}; CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')}"],
        )
    assert dst.index is not None
    p2p = src_index == dst.index or torch.cuda.can_device_access_peer(dst.index, src_index)
    args = (_unb64(share["handle"]), int(share["storage_nbytes"]), int(share["storage_offset"]),
            _unb64(share["ref_counter"]), int(share["ref_counter_offset"]), b"", False)  # fmt: skip
    storage, mode = None, "p2p"
    if p2p:  # map the exporter's memory into our own GPU's address space (peer access enabled lazily)
        try:
            storage = torch.UntypedStorage._new_shared_cuda(dst.index, *args)
        except RuntimeError as exc:
            log.warning("cuda_ipc: opening %s's KV on %s failed (%s); copying across devices instead",
                        gpu, dst, exc)  # fmt: skip
    if storage is None:
        mode = "staged" if src_index != dst.index else "p2p"
        try:
            storage = torch.UntypedStorage._new_shared_cuda(src_index, *args)
        except RuntimeError as exc:
            raise TransportError(f"cuda_ipc: cannot open the exporter's KV handle: {exc}") from exc
    offset = int(share["kv_offset"])
    if offset + kv_nbytes > storage.nbytes():
        raise TransportError(f"exporter's KV ({offset}+{kv_nbytes} bytes) lies outside its shared storage")
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    flat.set_(storage, offset, (kv_nbytes // block_nbytes, block_nbytes), (block_nbytes, 1))
    return PeerKV(flat, mode, gpu)


def open_board(share: object, address: str) -> BoardView | None:
    """The fetcher's map of an exporter's lease board (the `board` of its share), or None: without
    one every fetch asks first (counted as such in describe()); no error, nothing is lost."""
    if not isinstance(share, dict):
        return None
    try:
        return BoardView(str(share["path"]), int(share["slots"]))
    except (KeyError, OSError, ValueError) as exc:
        log.warning("cuda_ipc: cannot map the lease board of %s (%s): its fetches ask first", address, exc)
        return None
