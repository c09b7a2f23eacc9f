"""The worker's feed of its prefix cache's events (worker/kv_events.py) without a core: a new follower or
one of another epoch gets a snapshot, one in step gets the events after its last, one that fell behind
the recent events gets a snapshot, and a long poll answers as soon as events come."""

from __future__ import annotations

import asyncio

from splitserve.wire.core import CacheEvents
from splitserve.wire.kv_events import CacheLoad, KVEvent, KVEventsQuery
from splitserve.worker.kv_events import KVEventFeed

LOAD = CacheLoad(unfinished=1, blocks_free=10, blocks_total=16)


def _batch(*events: KVEvent) -> CacheEvents:
    return CacheEvents(list(events), LOAD, False)


def test_snapshot_then_events_then_snapshot_when_behind():
    async def run() -> None:
        feed = KVEventFeed(block_size=16, recent=2)
        first = await feed.page(KVEventsQuery())
        assert first.snapshot is not None and first.snapshot.stored == [] and first.seq == 0
        feed.apply(_batch(KVEvent(1, "stored", [b"a", b"b"]), KVEvent(2, "removed", [b"a"])))
        page = await feed.page(KVEventsQuery(epoch=feed.epoch, after=1))
        assert page.snapshot is None and [e.seq for e in page.events] == [2] and page.load == LOAD
        feed.apply(_batch(KVEvent(3, "stored", [b"c"])))  # event 1 leaves the two recent ones
        behind = await feed.page(KVEventsQuery(epoch=feed.epoch, after=0))
        assert behind.snapshot is not None and sorted(behind.snapshot.stored) == [b"b", b"c"]
        assert behind.seq == 3
        other = await feed.page(KVEventsQuery(epoch="another", after=3))
        assert other.snapshot is not None and other.epoch == feed.epoch

    asyncio.run(run())


def test_a_long_poll_answers_when_events_come_and_heartbeats_without():
    async def run() -> None:
        feed = KVEventFeed(block_size=16)
        idle = await feed.page(KVEventsQuery(epoch=feed.epoch, after=0, wait_s=0.01))
        assert idle.snapshot is None and idle.events == [] and idle.seq == 0
        waiting = asyncio.create_task(feed.page(KVEventsQuery(epoch=feed.epoch, after=0, wait_s=30)))
        await asyncio.sleep(0)
        feed.apply(_batch(KVEvent(1, "checkpoint_stored", [b"x"])))
        page = await asyncio.wait_for(waiting, 5)
        assert [(e.kind, e.hashes) for e in page.events] == [("checkpoint_stored", [b"x"])]
        assert list(feed.checkpoints) == [b"x"]

    asyncio.run(run())
