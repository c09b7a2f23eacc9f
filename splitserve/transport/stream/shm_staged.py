"""Staged shm: the payload streams through two slots of a segment the exporter creates per connection.

Used when the exporter's KV is ordinary process memory (the general case). Life of one fetch:
  1. exporter: on the connection's first fetch, creates a two-slot `SharedMemory` segment (name
     `ss_kv_<pid>_<16 random hex>`, unique by O_EXCL); copies the first chunk of the payload out of
     its leased blocks into slot 0 -> KvShm {segment, slot_nbytes, nbytes, checksum,
     chunk: {slot, pos, nbytes}}
  2. fetcher: maps the segment if it has not yet (without registering it with its own resource
     tracker: it does not own it), copies the chunk into its kv[into_block_ids] -> Ack.
     Meanwhile the exporter fills the other slot -> Chunk {slot, pos, nbytes}; and so on,
     the two copies overlapping, each slot reused only after its ack.
  3. The first ack tells the exporter the fetcher has the segment mapped: it unlinks the name then.
     Both keep their mappings for the connection's later fetches; the memory goes back to the OS when
     both unmap (connection closed). So a crash of either side after the first ack cannot leave
     anything in /dev/shm; before it, the exporter unlinks on any error or when the connection
     ends, and its resource tracker does if the exporter process dies.

NOTE: why one segment per connection and not a fresh one per transfer: first-touch page faults on new
shared memory run at ~1 GB/s on a VM (against ~6 GB/s for a warm memcpy), so a per-transfer segment
would cap the backend far below a memcpy; a reused, pre-faulted pair of slots does not.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import mmap
import os
import re
import secrets
from multiprocessing import shared_memory

import numpy as np

from splitserve.transport.client import SyncChannel
from splitserve.transport.errors import TransportError
from splitserve.transport.fault_plan import Fault, FaultPlan
from splitserve.transport.frames import Ack, Chunk, KvShm
from splitserve.transport.payload import ByteStream
from splitserve.transport.protocol import Deadline, expect
from splitserve.transport.server import AsyncChannel

log = logging.getLogger(__name__)

SEGMENT_PREFIX = "ss_kv_"  # a prefix only; every name gets the pid and 16 random hex digits
_NAME_OK = re.compile(r"[A-Za-z0-9_.-]{1,200}")
INLINE_COPY_BYTES = 1 << 20  # smaller chunks are copied on the loop thread, larger ones off it


def chunk_nbytes(nbytes: int, slot_nbytes: int) -> int:
    """Chunks small enough for the two copies to overlap (>= 4 per payload), large enough that the
    two messages per chunk stay cheap (>= 1 MiB), and at most a slot."""
    return min(slot_nbytes, max(INLINE_COPY_BYTES, -(-nbytes // 4)))


class SharedArena:
    """Exporter side: a two-slot segment it creates, unlinks early and unmaps with the connection."""

    def __init__(self, slot_nbytes: int) -> None:
        self.slot_nbytes = slot_nbytes
        self.name = f"{SEGMENT_PREFIX}{os.getpid()}_{secrets.token_hex(8)}"
        self._shm = shared_memory.SharedMemory(name=self.name, create=True, size=2 * slot_nbytes)
        self._array: np.ndarray | None = np.ndarray((2 * slot_nbytes,), np.uint8, buffer=self._shm.buf)
        self._linked = True

    def slot(self, i: int) -> np.ndarray:
        assert self._array is not None
        return self._array[i * self.slot_nbytes : (i + 1) * self.slot_nbytes]

    def unlink(self) -> None:
        if self._linked:
            self._linked = False
            with contextlib.suppress(FileNotFoundError):
                self._shm.unlink()  # also tells our resource tracker to forget it

    def close(self) -> None:
        self.unlink()
        self._array = None
        try:
            self._shm.close()
        except BufferError:  # a copy still runs on a worker thread; the mapping goes with the process
            log.warning("kv shm segment %s still in use at close; left mapped", self.name)


class AttachedArena:
    """Fetcher side: maps the exporter's segment without registering it with our resource tracker.

    NOTE: `SharedMemory(name)` on Python < 3.13 registers the segment with the resource tracker of
    the process that attaches, which then unlinks it (and warns about a "leak") when that process
    exits, or, when the tracker is shared with the exporter (spawned children), unregisters the
    exporter's own registration. Opening it with shm_open + mmap keeps ownership with the creator.
    """

    def __init__(self, name: str, slot_nbytes: int) -> None:
        import _posixshmem  # CPython's shm_open, what multiprocessing.shared_memory uses

        if not _NAME_OK.fullmatch(name):
            raise TransportError(f"exporter sent a bad shm segment name {name!r}")
        self.name, self.slot_nbytes = name, slot_nbytes
        try:
            fd = _posixshmem.shm_open("/" + name, os.O_RDWR, mode=0o600)
        except OSError as exc:
            raise TransportError(
                f"cannot open shm segment {name!r}: {exc} (exporter on another host?)"
            ) from exc
        try:
            size = os.fstat(fd).st_size
            if size < 2 * slot_nbytes:
                raise TransportError(f"shm segment {name!r} has {size} bytes, expected {2 * slot_nbytes}")
            self._mmap = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self._array: np.ndarray | None = np.frombuffer(self._mmap, dtype=np.uint8)

    def slot(self, i: int) -> np.ndarray:
        assert self._array is not None
        return self._array[i * self.slot_nbytes : (i + 1) * self.slot_nbytes]

    def close(self) -> None:
        self._array = None
        try:
            self._mmap.close()
        except BufferError:
            log.warning("kv shm mapping %s still in use at close", self.name)


async def send_staged(
    chan: AsyncChannel,
    stream: ByteStream,
    blocks: int,
    checksum: str | None,
    slot_nbytes: int,
    deadline: Deadline,
    fault: Fault = Fault.NONE,
    faults: FaultPlan | None = None,
) -> None:
    """Exporter: stream the payload through the connection's two slots (steps 1-3 above)."""
    arena = chan.attached.get("shm")
    if arena is None:
        arena = chan.attached["shm"] = SharedArena(slot_nbytes)
    chunk = chunk_nbytes(stream.nbytes, arena.slot_nbytes)
    nchunks = -(-stream.nbytes // chunk)
    for i in range(nchunks):
        if fault is Fault.KILL and i == nchunks // 2:
            return
        if i >= 2:
            await _ack(chan, arena, deadline)
        view = arena.slot(i % 2)[: min(chunk, stream.nbytes - i * chunk)]
        if view.nbytes <= INLINE_COPY_BYTES:
            stream.copy_to(i * chunk, view)
        else:  # numpy releases the GIL: the loop (and the engine's threads) keep running
            await asyncio.to_thread(stream.copy_to, i * chunk, view)
        if fault is Fault.CORRUPT and i == 0 and faults is not None:
            faults.flip(view)
        where = Chunk(slot=i % 2, pos=i * chunk, nbytes=view.nbytes)
        if i == 0:
            first = KvShm(blocks=blocks, checksum=checksum, nbytes=stream.nbytes, segment=arena.name,
                          slot_nbytes=arena.slot_nbytes, chunk=where)  # fmt: skip
            await chan.send(first, deadline)
        else:
            await chan.send(where, deadline)
    for _ in range(min(2, nchunks)):
        await _ack(chan, arena, deadline)


async def _ack(chan: AsyncChannel, arena: SharedArena, deadline: Deadline) -> None:
    expect(await chan.recv(deadline), Ack)
    arena.unlink()  # an ack means the fetcher has it mapped: the name can go (no-op after the first)


def recv_staged(chan: SyncChannel, meta: KvShm, stream: ByteStream, deadline: Deadline) -> None:
    """Fetcher: copy each announced chunk out of its slot into `stream`, acking each."""
    arena = chan.attached.get("shm")
    if arena is None or arena.name != meta.segment:
        if arena is not None:
            arena.close()
        arena = chan.attached["shm"] = AttachedArena(meta.segment, meta.slot_nbytes)
    chunk, pos = meta.chunk, 0
    while True:
        slot, at, n = chunk.slot, chunk.pos, chunk.nbytes
        if slot not in (0, 1) or at != pos or not 0 < n <= arena.slot_nbytes or at + n > stream.nbytes:
            raise TransportError(f"bad shm chunk {chunk} at byte {pos} of {stream.nbytes}")
        stream.copy_from(at, arena.slot(slot)[:n])
        chan.send(Ack(slot=slot), deadline)
        pos += n
        if pos == stream.nbytes:
            return
        chunk = expect(chan.recv(deadline)[0], Chunk)
