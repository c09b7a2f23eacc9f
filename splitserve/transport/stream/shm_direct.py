"""Direct shm: the exporter's whole KV cache lives in shared memory; the fetcher copies blocks straight
out of it: one memcpy per transfer, done by the fetcher, instead of two (out to a slot and back in).

Life of a request's KV in direct mode:
  0. start-up: the exporter allocates its cache with `allocate_shared_kv(shape, dtype)`: a memfd
     (anonymous: it never has a name in /dev/shm, so nothing can leak there) mapped as the tensor.
     ShmTransport sees that its kv is such a tensor and serves fetches in direct mode.
  1. fetcher -> Fetch {lease_id}; exporter (the lease pinned) -> KvDirect {
     block_ids, nbytes, checksum, kv_nbytes} + the state tensors as the frame body; on the
     connection's first fetch the memfd rides along (SCM_RIGHTS on the unix socket).
  2. fetcher: maps the cache read-only (once per connection), reads the state body, copies
     kv_src[block_ids] -> kv[into_block_ids] (one memcpy per run of ids consecutive on both sides),
     checks its deadline, -> Done.
  3. exporter: drops its pin on "done" (or at the deadline, or when the fetcher hangs up), so the
     blocks can be freed or reused only once the fetcher has stopped reading them.

NOTE: the fetcher can read the exporter's whole KV (not write it: the mapping is read-only); it got
the descriptor only after proving the shared secret.
"""

from __future__ import annotations

import math
import mmap
import os
import threading
import weakref
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.transport.client import SyncChannel
from splitserve.transport.errors import TransportError
from splitserve.transport.fault_plan import Fault
from splitserve.transport.frames import Done, KvDirect, Select
from splitserve.transport.layout import KVLayout
from splitserve.transport.payload import ByteStream, block_runs, check_select, head_pieces
from splitserve.transport.protocol import Deadline, expect
from splitserve.transport.server import AsyncChannel


@dataclass(frozen=True)
class SharedKV:
    fd: int  # the memfd behind the tensor, passed to fetchers
    nbytes: int
    block_nbytes: int


# NOTE: a process-wide fact, not configuration: which tensors of this process live in shared memory.
_SHARED: dict[int, SharedKV] = {}
_LOCK = threading.Lock()


def allocate_shared_kv(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled KV tensor [num_blocks, L, 2, block_size, KVH, D] in shared memory (Linux memfd).

    Pages are touched lazily, like the engine's calloc'ed cache. Keep the returned tensor itself
    alive while serving (views of it are not enough): when it is collected the transport no longer
    recognises the memory as shared; the memory goes once no process maps it.
    """
    if not hasattr(os, "memfd_create"):
        raise OSError("allocate_shared_kv needs os.memfd_create (Linux)")
    nbytes = math.prod(shape) * dtype.itemsize
    fd = os.memfd_create("splitserve-kv", os.MFD_CLOEXEC)
    os.ftruncate(fd, nbytes)
    buf = mmap.mmap(fd, nbytes)
    kv = torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(tuple(shape))
    with _LOCK:
        _SHARED[kv.data_ptr()] = SharedKV(fd, nbytes, nbytes // shape[0])
    weakref.finalize(kv, _forget, kv.data_ptr(), fd)
    return kv


def _forget(data_ptr: int, fd: int) -> None:
    with _LOCK:
        _SHARED.pop(data_ptr, None)
    os.close(fd)


def shared_kv_of(kv: torch.Tensor) -> SharedKV | None:
    """The shared allocation behind `kv`, if it is one made by allocate_shared_kv (whole, unsliced)."""
    with _LOCK:
        shared = _SHARED.get(kv.data_ptr())
    if shared is None or not kv.is_contiguous() or kv.numel() * kv.element_size() != shared.nbytes:
        return None
    return shared


class MappedKV:
    """Fetcher side: the exporter's KV cache, mapped read-only; closed with the connection."""

    def __init__(self, fd: int, nbytes: int, block_nbytes: int) -> None:
        try:
            if os.fstat(fd).st_size < nbytes or block_nbytes <= 0 or nbytes % block_nbytes:
                raise TransportError(f"exporter passed a KV descriptor that does not hold {nbytes} bytes")
            self._mmap = mmap.mmap(fd, nbytes, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.rows: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8).reshape(-1, block_nbytes)

    def blocks(
        self, block_ids: Sequence[int], layout: KVLayout | None = None, select: Select | None = None
    ) -> ByteStream:
        """The named blocks (only the `select`ed heads of them, in the exporter's `layout`)."""
        rows = self.rows
        assert rows is not None
        if not block_ids or min(block_ids) < 0 or max(block_ids) >= rows.shape[0]:
            raise TransportError(f"exporter named blocks outside its cache: {list(block_ids)[:16]}")
        if select is not None and layout is not None:
            check_select(layout, select)
            return ByteStream(head_pieces(rows, layout, block_ids, select.heads))
        return ByteStream([rows[start : start + n].reshape(-1) for start, n in block_runs(block_ids)])

    def close(self) -> None:
        self.rows = None
        self._mmap.close()


async def send_direct(
    chan: AsyncChannel,
    shared: SharedKV,
    block_ids: Sequence[int],
    state: ByteStream,
    checksum: str | None,
    deadline: Deadline,
    fault: Fault = Fault.NONE,
) -> None:
    """Exporter: name the blocks (and pass the cache's fd once), send the state, wait for "done"."""
    if fault is Fault.KILL:
        return  # hang up instead of answering: the fetcher must fail, not hang
    ids = list(block_ids)
    if fault is Fault.CORRUPT:
        ids = ids[1:] + ids[:1]  # point the fetcher at the wrong blocks: the checksum must notice
    first = "kv_fd" not in chan.notes
    header = KvDirect(blocks=len(ids), checksum=checksum, block_ids=tuple(ids), kv_nbytes=shared.nbytes,
                      block_nbytes=shared.block_nbytes, fd=first)  # fmt: skip
    await chan.send(header, deadline, state.nbytes, (shared.fd,) if first else ())
    chan.notes.add("kv_fd")
    await chan.send_stream(state, deadline)
    expect(await chan.recv(deadline), Done)


def recv_direct(
    chan: SyncChannel,
    meta: KvDirect,
    body_nbytes: int,
    stream: ByteStream,
    deadline: Deadline,
    select: Select | None = None,
) -> None:
    """Fetcher: read the state body, copy the named blocks (the `select`ed heads of them) out of the
    mapped cache into `stream`."""
    mapped = chan.attached.get("shm_kv")
    if meta.fd:
        if not chan.fds:
            raise TransportError("exporter announced its KV descriptor but none arrived")
        if mapped is not None:
            mapped.close()
        fd = chan.fds.pop(0)
        mapped = chan.attached["shm_kv"] = MappedKV(fd, meta.kv_nbytes, meta.block_nbytes)
    if mapped is None:
        raise TransportError("exporter sent a direct-mode answer on a connection without a KV mapping")
    src = mapped.blocks(meta.block_ids, chan.peer_layout, select)
    if src.nbytes + body_nbytes != stream.nbytes:
        raise TransportError(f"exporter sends {src.nbytes} + {body_nbytes} bytes, we expect {stream.nbytes}")
    chan.recv_stream(stream.sub(src.nbytes, body_nbytes), deadline)
    stream.copy_stream(src)
    deadline.remaining("copy out of the exporter's KV")  # past it the exporter may have unpinned
    chan.send(Done(), deadline)
