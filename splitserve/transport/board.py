"""The lease board: which leases are live, in a page of shared memory, for one-sided reads on one host.

A cuda_ipc fetcher has the exporter's KV mapped into its own GPU's address space, so it can copy the
blocks without asking (the way a NIXL/RDMA READ needs no work from the target). What it cannot see
without asking is whether the lease still holds the blocks. The board answers that without a round
trip: the exporter publishes each live lease as a 64-bit tag in a slot of a shared file, and clears
the slot *before* the lease's blocks go back to its engine (`LeaseManager._pop` clears, `_free` runs
after). The fetcher reads the slot, copies, waits for the copy, and reads the slot again: still the
lease's tag means the blocks were not handed back before the copy finished, so the bytes are the
prefill's. Anything else (cleared, reused, the exporter asks for two-sided fetches) sends the fetch
down the ordinary request/answer path, which answers with the lease's real fate.

Layout: word 0 is flags (bit 0: one-sided reads allowed; the exporter clears it while faults are
injected, so tests of the two-sided path stay meaningful), words 1..slots are the slots: 0 = empty,
else the tag of the lease in it. A tag comes from the lease id (`lease_tag`), so the handle needs to
carry only the slot. A full board just means new leases get no slot (two-sided fetches).

NOTE: the board is no authority: a fetcher gets its path only over the authenticated channel, it
says nothing about the bytes, and the worst a forged slot value can do is make a fetch two-sided or
accept a read of blocks the fetcher could read anyway. The file is 0600 in /dev/shm (or the socket
directory) and unlinked when the exporter closes. The exporter holds an exclusive flock on it for its
life, so the board of an exporter that died without closing is found and removed by the next one
made in that directory (`sweep_stale`; flocks work across PID namespaces, unlike a pid check).
"""

from __future__ import annotations

import fcntl
import hashlib
import mmap
import os
import tempfile
import threading
import time

import numpy as np

from splitserve.transport.frames import BoardShare
from splitserve.wire.transport_info import BoardInfo

ONE_SIDED = 1  # flags bit: fetchers may read without asking
DEFAULT_SLOTS = 8191  # + the flags word: 64 KiB
PREFIX = "splitserve-leases-"
STALE_AFTER_S = 60.0  # a board file this old that nobody holds locked belongs to a dead exporter


def lease_tag(lease_id: str) -> int:
    """A lease's non-zero 63-bit tag, the same in every process (a stale slot never matches a new
    lease: ids are random)."""
    digest = hashlib.blake2b(lease_id.encode(), digest_size=8).digest()
    return (int.from_bytes(digest, "little") >> 1) or 1


def _shm_dir(directory: str | None) -> str | None:
    if directory:
        return directory
    return "/dev/shm" if os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK) else None


class LeaseBoard:
    """Exporter side: owns the file; `post` a lease's tag, `clear` it before its blocks are freed."""

    def __init__(self, slots: int = DEFAULT_SLOTS, directory: str | None = None) -> None:
        where = _shm_dir(directory)
        sweep_stale(where or tempfile.gettempdir())
        fd, self.path = tempfile.mkstemp(prefix=PREFIX, dir=where)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)  # held until close (or our death)
            os.fchmod(fd, 0o600)
            os.ftruncate(fd, 8 * (slots + 1))
            self._map = mmap.mmap(fd, 8 * (slots + 1))
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        self._fd = fd
        self.slots = slots
        self.words = np.frombuffer(self._map, dtype=np.uint64)
        self.words[0] = ONE_SIDED
        self._free = list(range(slots, 0, -1))  # pop() hands out slot 1 first
        self._lock = threading.Lock()
        self.full = 0  # leases that found no slot

    def post(self, lease_id: str) -> int | None:
        """Publish a new lease; -> its slot, or None when the board is full."""
        with self._lock:
            if not self._free:
                self.full += 1
                return None
            slot = self._free.pop()
        self.words[slot] = lease_tag(lease_id)
        return slot

    def clear(self, slot: int | None) -> None:
        """The lease in `slot` ended: clear it (call before its blocks are freed), recycle the slot."""
        if slot is None:
            return
        self.words[slot] = 0
        with self._lock:
            self._free.append(slot)

    def allow_one_sided(self, allowed: bool) -> None:
        self.words[0] = ONE_SIDED if allowed else 0

    def share(self) -> BoardShare:
        return BoardShare(self.path, self.slots)

    def describe(self) -> BoardInfo:
        with self._lock:
            used = self.slots - len(self._free)
        return BoardInfo(self.path, self.slots, used, self.full, bool(int(self.words[0])))

    def close(self) -> None:
        """Unlink the file and unmap it (idempotent); fetchers that mapped it keep their copy, whose
        slots stay as they were: live leases of a dead exporter hold KV that was whole at export."""
        if self._map.closed:
            return
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        self.words[:] = 0  # in the shared file: no lease reads as live (even one still pinned here)
        self.words = np.zeros(self.slots + 1, dtype=np.uint64)  # late clears land here harmlessly
        try:
            self._map.close()
        except BufferError:  # a view of the map is still alive somewhere; it goes with the process
            pass
        os.close(self._fd)  # and with it the flock


def sweep_stale(directory: str) -> int:
    """Remove the board files in `directory` whose exporter died without closing them (older than
    STALE_AFTER_S and not flocked by anyone); -> how many."""
    removed = 0
    try:
        names = [n for n in os.listdir(directory) if n.startswith(PREFIX)]
    except OSError:
        return 0
    for name in names:
        path = os.path.join(directory, name)
        try:
            if time.time() - os.stat(path).st_mtime < STALE_AFTER_S:
                continue  # perhaps made a moment ago and not locked yet
            fd = os.open(path, os.O_RDONLY)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            os.close(fd)
            continue  # its exporter is alive
        try:
            os.unlink(path)
            removed += 1
        except OSError:
            pass
        finally:
            os.close(fd)
    return removed


class BoardView:
    """Fetcher side: a read-only map of an exporter's board."""

    def __init__(self, path: str, slots: int) -> None:
        fd = os.open(path, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size != 8 * (slots + 1):
                raise ValueError(f"lease board {path} is {size} bytes, expected {8 * (slots + 1)}")
            self._map = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        finally:
            os.close(fd)
        self.path = path
        self.slots = slots
        self.words = np.frombuffer(self._map, dtype=np.uint64)

    def one_sided(self) -> bool:
        return bool(int(self.words[0]) & ONE_SIDED)

    def live(self, slot: int, lease_id: str) -> bool:
        """The lease in `slot` is still `lease_id`'s (and one-sided reads are allowed)."""
        if not 0 < slot <= self.slots:
            return False
        return self.one_sided() and int(self.words[slot]) == lease_tag(lease_id)
