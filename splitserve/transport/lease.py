"""Leases: the exporter holds a request's blocks until the fetcher releases them or time runs out.

Life of a lease:
  1. `grant(block_ids, payload)` on export: the blocks are now the lease's; it ends at
     `now + lease_s` (monotonic clock).
  2. A fetch `pin`s it while bytes are read out of the blocks, so that an expiry or release arriving
     mid-transfer cannot hand the blocks back to the engine under the reader's feet: the end is deferred
     until the last pin is dropped.
  3. It ends once, by `release` (the fetcher is done) or by expiry (the reaper thread): `on_free(block_ids)`
     is called exactly once, outside the lock, on whichever thread ended it.
  4. With a `LeaseBoard` (cuda_ipc), a live lease is also published in shared memory for one-sided
     reads (board.py); its slot is cleared when it ends, before `on_free`.
  5. A second release, a release after expiry, or a late fetch is harmless: the ended lease is
     remembered (bounded) so that a late fetch gets `LeaseExpired`, not a confusing "unknown lease".

NOTE: `on_free` may run on any thread (caller, server loop, reaper); keep it short and thread-safe,
e.g. put the ids on a queue that the engine drains in `step()`.
"""

from __future__ import annotations

import heapq
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from splitserve.transport.board import LeaseBoard
from splitserve.transport.errors import LeaseExpired, UnknownLease

log = logging.getLogger(__name__)

FreeCallback = Callable[[list[int]], None]


@dataclass(frozen=True)
class Lease:
    lease_id: str
    block_ids: tuple[int, ...]
    expires_at: float  # monotonic
    payload: Any = None  # what the exporter needs to serve a fetch (request id, state, checksum)
    slot: int | None = None  # its slot on the lease board, if there is one and it had room


class LeaseManager:
    def __init__(
        self,
        lease_s: float,
        on_free: FreeCallback | None = None,
        clock: Callable[[], float] = time.monotonic,
        remember: int = 4096,
        board: LeaseBoard | None = None,
        reaper: bool = True,
    ) -> None:
        """`reaper=False`: no thread ends leases on time; the owner calls `expire_due()` itself (a test
        that drives `clock` by hand must, or the thread would race it on the same deadlines)."""
        if lease_s <= 0:
            raise ValueError(f"lease_s must be > 0, got {lease_s}")
        self.lease_s = lease_s
        self._on_free = on_free or (lambda ids: None)
        self._clock = clock
        self._remember = remember
        self.board = board
        self._cond = threading.Condition()
        self._leases: dict[str, Lease] = {}
        self._pins: Counter[str] = Counter()
        self._doomed: dict[str, str] = {}  # lease_id -> why it ends once unpinned
        self._ended: OrderedDict[str, str] = OrderedDict()  # lease_id -> "released" | "expired"
        self._heap: list[tuple[float, str]] = []
        self._reaper: threading.Thread | None = None
        self._reaper_wanted = reaper
        self._closed = False
        self.counts: Counter[str] = Counter()
        self.on_end: Callable[[Lease], None] | None = None  # after the lease ended, before on_free

    # -- exporter side ------------------------------------------------------------------------
    def grant(self, block_ids: Sequence[int], payload: Any = None) -> Lease:
        lease_id = secrets.token_hex(12)
        with self._cond:
            if self._closed:
                raise RuntimeError("lease manager is closed")
            slot = self.board.post(lease_id) if self.board is not None else None
            lease = Lease(lease_id, tuple(block_ids), self._clock() + self.lease_s, payload, slot)
            self._leases[lease.lease_id] = lease
            heapq.heappush(self._heap, (lease.expires_at, lease.lease_id))
            self.counts["granted"] += 1
            self._start_reaper()
            self._cond.notify()
        return lease

    def release(self, lease_id: str) -> bool:
        """End a lease now; True when this call ended it (or will, once its fetch is done)."""
        return self._end(lease_id, "released")

    @contextmanager
    def pinned(self, lease_id: str) -> Iterator[Lease]:
        """Hold a live lease for the duration of a transfer; raises LeaseExpired or UnknownLease."""
        with self._cond:
            lease = self._leases.get(lease_id)
            why = self._doomed.get(lease_id) if lease is not None else self._ended.get(lease_id)
            overdue = lease is not None and why is None and self._clock() >= lease.expires_at
            if lease is not None and why is None and not overdue:
                self._pins[lease_id] += 1
        if overdue:  # the reaper has not come round yet: end it here
            self._end(lease_id, "expired")
            why = "expired"
        if lease is None and why is None:
            raise UnknownLease(f"no lease {lease_id!r} here")
        if why is not None:
            raise LeaseExpired(f"lease {lease_id!r} was {why}")
        try:
            yield lease
        finally:
            self._unpin(lease_id)

    def active(self) -> int:
        with self._cond:
            return len(self._leases)

    def expire_due(self) -> int:
        """End every lease past its deadline; returns how many ended. The reaper calls this."""
        with self._cond:
            now, due = self._clock(), []
            while self._heap and self._heap[0][0] <= now:
                due.append(heapq.heappop(self._heap)[1])
        return sum(self._end(lease_id, "expired") for lease_id in due)

    def close(self, free_remaining: bool = True) -> None:
        """Stop the reaper; by default end (and free) every lease still held."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
            remaining = list(self._leases)
        if free_remaining:
            for lease_id in remaining:
                self._end(lease_id, "released")
        if self._reaper is not None and self._reaper is not threading.current_thread():
            self._reaper.join(timeout=5)

    # -- internals ----------------------------------------------------------------------------
    def _end(self, lease_id: str, why: str) -> bool:
        with self._cond:
            if lease_id not in self._leases or lease_id in self._doomed:
                return False
            if self._pins[lease_id] > 0:
                self._doomed[lease_id] = why
                return True
            lease = self._pop(lease_id, why)
        self._free(lease, why)
        return True

    def _unpin(self, lease_id: str) -> None:
        with self._cond:
            self._pins[lease_id] -= 1
            if self._pins[lease_id] > 0:
                return
            del self._pins[lease_id]
            why = self._doomed.get(lease_id)
            if why is None:
                return
            lease = self._pop(lease_id, why)
        self._free(lease, why)

    def _pop(self, lease_id: str, why: str) -> Lease:
        # NOTE: the caller holds the lock; popping is what makes the free happen exactly once.
        lease = self._leases.pop(lease_id)
        if self.board is not None:  # one-sided readers see it end before its blocks can be reused
            self.board.clear(lease.slot)
        self._pins.pop(lease_id, None)
        self._doomed.pop(lease_id, None)
        self._ended[lease_id] = why
        while len(self._ended) > self._remember:
            self._ended.popitem(last=False)
        self.counts[why] += 1
        return lease

    def _free(self, lease: Lease, why: str) -> None:
        if self.on_end is not None:
            try:
                self.on_end(lease)
            except Exception:
                log.exception("kv lease %s: on_end raised (lease %s)", lease.lease_id, why)
        try:
            self._on_free(list(lease.block_ids))
        except Exception:  # the lease still ended: a retry could free twice
            log.exception("kv lease %s: on_free raised (lease %s)", lease.lease_id, why)

    def _start_reaper(self) -> None:
        if self._reaper is None and self._reaper_wanted:
            self._reaper = threading.Thread(target=self._reap_forever, name="kv-lease-reaper", daemon=True)
            self._reaper.start()

    def _reap_forever(self) -> None:
        while True:
            with self._cond:
                if self._closed:
                    return
                wait = self._heap[0][0] - self._clock() if self._heap else None
                if wait is None or wait > 0:
                    self._cond.wait(timeout=wait)
                    continue
            self.expire_due()
