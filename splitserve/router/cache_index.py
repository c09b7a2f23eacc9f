"""The router's view of one replica's prefix cache: `ReplicaIndex`, the block hashes the replica's own
events say it holds (wire/kv_events.py), and how much of a prompt it would find.

A follower (cache_follow.py) applies each page the replica answers: a snapshot replaces the view; events
must follow on from the last one applied (`seq`), else the view is dropped (`seq` -1) and the next poll
asks for a snapshot. A replica restarted under the same name answers with another epoch, hence a snapshot.
"""

from __future__ import annotations

from splitserve.wire.kv_events import CacheLoad, KVEvent, KVEventsPage


class ReplicaIndex:
    def __init__(self, name: str) -> None:
        self.name = name
        self.epoch = ""  # the worker process's, as its last page said
        self.seq = -1  # the last event applied; -1: no view (the next poll asks for a snapshot)
        self.stored: set[bytes] = set()
        self.checkpoints: set[bytes] = set()
        self.hybrid = False
        self.block_size = 0
        self.load: CacheLoad | None = None
        self.seen = float("-inf")  # time.monotonic() of the last page

    @property
    def synced(self) -> bool:
        return self.seq >= 0

    def fresh(self, now: float, stale_s: float) -> bool:
        """Whether routing may trust this view: in step with the replica, and heard from lately."""
        return self.synced and now - self.seen <= stale_s

    def kv_usage(self) -> float:
        load = self.load
        return 0.0 if load is None or not load.blocks_total else 1.0 - load.blocks_free / load.blocks_total

    def apply(self, page: KVEventsPage, now: float) -> str | None:
        """Take one page; -> why the view was rebuilt or dropped ("start", "restart", "behind", "gap"),
        or None when it just went on."""
        self.seen, self.hybrid, self.block_size = now, page.hybrid, page.block_size
        if page.load is not None:
            self.load = page.load
        if page.snapshot is not None:
            why = "start" if not self.epoch else "restart" if page.epoch != self.epoch else "behind"
            self.stored = set(page.snapshot.stored)
            self.checkpoints = set(page.snapshot.checkpoints)
            self.epoch, self.seq = page.epoch, page.seq
            return why
        if page.epoch != self.epoch or not self.synced:
            self.seq = -1
            return "gap"
        for ev in page.events:
            if ev.seq <= self.seq:
                continue  # already applied
            if ev.seq != self.seq + 1:
                self.seq = -1
                return "gap"
            self._apply(ev)
            self.seq = ev.seq
        return None

    def _apply(self, ev: KVEvent) -> None:
        if ev.kind == "stored":
            self.stored.update(ev.hashes)
        elif ev.kind == "removed":
            self.stored.difference_update(ev.hashes)
        elif ev.kind == "cleared":
            self.stored.clear()
        elif ev.kind == "checkpoint_stored":
            self.checkpoints.update(ev.hashes)
        else:
            self.checkpoints.difference_update(ev.hashes)

    def match(self, hashes: list[bytes]) -> tuple[int, int]:
        """(the prompt's leading blocks cached here, of them those the engine can use: for a hybrid model,
        up to the last one that ends at a state checkpoint)."""
        n = 0
        for h in hashes:
            if h not in self.stored:
                break
            n += 1
        if not self.hybrid:
            return n, n
        usable = n
        while usable and hashes[usable - 1] not in self.checkpoints:
            usable -= 1
        return n, usable


__all__ = ["ReplicaIndex"]
