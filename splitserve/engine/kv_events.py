"""The engine's prefix-cache event log: what the block pool and the state checkpoints record as blocks
become findable or are evicted, numbered, for the engine core to send its front end once per turn
(wire/kv_events.py tells who follows them and why).

Recording is a list append on the engine thread; `drain` merges consecutive events of one kind into one
(a prefill caching 32 blocks is one `stored` event of 32 hashes) and numbers them.
"""

from __future__ import annotations

from typing import Any

from splitserve.wire.kv_events import EventKind, KVEvent


class KVEventLog:
    def __init__(self, hybrid: bool = False) -> None:
        self.seq = 0  # the last number handed out
        self.hybrid = hybrid  # recurrent-state checkpoints bound what a prefix hit can use
        self._pending: list[tuple[EventKind, bytes | None]] = []

    def record(self, kind: EventKind, block_hash: bytes | None) -> None:
        self._pending.append((kind, block_hash))

    def drain(self) -> list[KVEvent]:
        """The events recorded since the last drain, merged by kind and numbered."""
        if not self._pending:
            return []
        pending, self._pending = self._pending, []
        out: list[KVEvent] = []
        kind, hashes = pending[0][0], []
        for i, (k, h) in enumerate(pending):
            if i and (k != kind or k == "cleared"):  # a new kind (or another clear): a new event
                out.append(self._event(kind, hashes))
                kind, hashes = k, []
            if h is not None:
                hashes.append(h)
        out.append(self._event(kind, hashes))
        return out

    def _event(self, kind: EventKind, hashes: list[bytes]) -> KVEvent:
        self.seq += 1
        return KVEvent(self.seq, kind, hashes)


def attach(engine: Any) -> KVEventLog | None:
    """Have `engine`'s block pool and state checkpoints record into a new log; None without a prefix cache."""
    pool = engine.pool
    if not pool.enable_prefix_caching:
        return None
    checkpoints = engine.scheduler.block_manager.checkpoints
    log = KVEventLog(hybrid=checkpoints is not None)
    pool.events = log
    if checkpoints is not None:
        checkpoints.events = log
    return log


__all__ = ["KVEventLog", "attach"]
