"""The worker's side of cache-aware routing: `KVEventFeed` keeps what the engine core says of its prefix
cache (the `CacheEvents` of each batch) and answers GET /kv/events (wire/kv_events.py).

It keeps a mirror of the cache (the findable block hashes and, for hybrid models, the state
checkpoints), as the events build it, and the most recent events. A follower that has every event up to
`after` of this process's epoch gets the ones after it (waiting up to `wait_s` for some: a long poll);
one that follows another epoch (the worker restarted), is new, or fell behind the recent events gets a
snapshot of the mirror, which stands for every event up to `seq`.
"""

from __future__ import annotations

import asyncio
import secrets
from collections import deque

from splitserve.wire.core import CacheEvents
from splitserve.wire.kv_events import CacheLoad, KVEvent, KVEventsPage, KVEventsQuery, KVSnapshot

RECENT_EVENTS = 4096  # events kept for followers that are behind; further behind: a snapshot


class KVEventFeed:
    def __init__(self, block_size: int, recent: int = RECENT_EVENTS) -> None:
        self.epoch = secrets.token_hex(8)  # a new one per process: a restarted worker starts afresh
        self.block_size = block_size
        self.seq = 0
        self.hybrid = False
        self.load: CacheLoad | None = None
        self.stored: dict[bytes, None] = {}
        self.checkpoints: dict[bytes, None] = {}
        self.recent: deque[KVEvent] = deque(maxlen=recent)
        self._changed = asyncio.Event()

    def apply(self, batch: CacheEvents) -> None:
        """Event loop: one turn's events from the core."""
        self.hybrid, self.load = batch.hybrid, batch.load
        for ev in batch.events:
            self._apply(ev)
            self.recent.append(ev)
            self.seq = ev.seq
        self._changed.set()
        self._changed = asyncio.Event()

    def _apply(self, ev: KVEvent) -> None:
        if ev.kind == "stored":
            self.stored.update(dict.fromkeys(ev.hashes))
        elif ev.kind == "removed":
            for h in ev.hashes:
                self.stored.pop(h, None)
        elif ev.kind == "cleared":
            self.stored.clear()
        elif ev.kind == "checkpoint_stored":
            self.checkpoints.update(dict.fromkeys(ev.hashes))
        else:
            for h in ev.hashes:
                self.checkpoints.pop(h, None)

    def _can_follow(self, q: KVEventsQuery) -> bool:
        """Whether the caller's events up to `after` are this process's and the rest are still here."""
        if q.epoch != self.epoch or q.after < 0 or q.after > self.seq:
            return False
        return q.after == self.seq or (bool(self.recent) and self.recent[0].seq <= q.after + 1)

    async def page(self, q: KVEventsQuery) -> KVEventsPage:
        if not self._can_follow(q):
            snap = KVSnapshot(list(self.stored), list(self.checkpoints))
            return self._page(snapshot=snap)
        if q.after == self.seq and q.wait_s > 0:
            changed = self._changed
            try:
                await asyncio.wait_for(changed.wait(), q.wait_s)
            except TimeoutError:
                return self._page()  # a heartbeat: nothing new
            if not self._can_follow(q):  # fell behind while waiting (a burst past RECENT_EVENTS)
                return self._page(snapshot=KVSnapshot(list(self.stored), list(self.checkpoints)))
        events = []
        for ev in reversed(self.recent):
            if ev.seq <= q.after:
                break
            events.append(ev)
        events.reverse()
        return self._page(events=events)

    def _page(self, events: list[KVEvent] | None = None, snapshot: KVSnapshot | None = None) -> KVEventsPage:
        return KVEventsPage(self.epoch, self.seq, self.block_size, self.hybrid, events or [], snapshot,
                            self.load)  # fmt: skip


__all__ = ["KVEventFeed", "RECENT_EVENTS"]
