"""The cache-aware pick and the router's view of a replica's cache, on views built from events (no
processes: the deployment's behaviour is in test_cache_routing.py)."""

from __future__ import annotations

import time
from types import SimpleNamespace

from splitserve.config.manifest_sections import RouterSection
from splitserve.router.cache_follow import CacheFollower
from splitserve.router.cache_index import ReplicaIndex
from splitserve.router.dispatch import Picker
from splitserve.wire.kv_events import CacheLoad, KVEvent, KVEventsPage, KVSnapshot, block_hashes

BS = 16


def _page(seq: int, events=(), snapshot=None, epoch="e1", hybrid=False, load=None) -> KVEventsPage:
    return KVEventsPage(epoch, seq, BS, hybrid, list(events), snapshot, load)


def _synced(name: str, stored=(), checkpoints=(), hybrid=False, load=None) -> ReplicaIndex:
    idx = ReplicaIndex(name)
    idx.apply(_page(0, snapshot=KVSnapshot(list(stored), list(checkpoints)), hybrid=hybrid, load=load),
              time.monotonic())  # fmt: skip
    return idx


def test_view_applies_events_in_order_and_drops_itself_on_a_gap():
    prompt = list(range(100, 164))  # 4 blocks
    h = block_hashes(prompt, BS)
    idx = _synced("p0")
    assert idx.apply(_page(1, [KVEvent(1, "stored", h)]), time.monotonic()) is None
    assert idx.match(h) == (4, 4)
    assert idx.apply(_page(2, [KVEvent(2, "removed", h[2:])]), time.monotonic()) is None
    assert idx.match(h) == (2, 2)
    assert idx.apply(_page(4, [KVEvent(4, "stored", h[2:])]), time.monotonic()) == "gap"  # 3 is missing
    assert not idx.synced and not idx.fresh(time.monotonic(), 10.0)
    assert idx.apply(_page(4, snapshot=KVSnapshot(h, [])), time.monotonic()) == "behind"
    assert idx.synced and idx.match(h) == (4, 4)
    assert idx.apply(_page(0, snapshot=KVSnapshot([], []), epoch="e2"), time.monotonic()) == "restart"
    assert idx.match(h) == (0, 0) and idx.epoch == "e2"


def test_hybrid_prefix_is_usable_up_to_its_last_checkpoint():
    h = block_hashes(list(range(1, 1 + 6 * BS)), BS)
    idx = _synced("p0", stored=h, checkpoints=[h[1], h[3]], hybrid=True)
    assert idx.match(h) == (6, 4)
    idx.apply(_page(1, [KVEvent(1, "checkpoint_removed", [h[3]])], hybrid=True), time.monotonic())
    assert idx.match(h) == (6, 2)


def _picker(indexes: dict[str, ReplicaIndex], **knobs) -> tuple[Picker, list]:
    config = RouterSection(policy="cache_aware", cache_aware=knobs)
    workers = [SimpleNamespace(name=n, inflight=0, url=None) for n in sorted(indexes)]
    follower = CacheFollower(SimpleNamespace(ready=lambda role: workers), ("prefill",), config.cache_aware)
    follower.indexes.update(indexes)
    from splitserve.router.cache_policy import CacheAwarePolicy

    return Picker(config, BS, CacheAwarePolicy(config, BS, follower)), workers


def test_the_replica_holding_the_prefix_wins_until_its_queue_outweighs_it():
    prompt = list(range(1000, 1000 + 32 * BS))
    h = block_hashes(prompt, BS)
    picker, workers = _picker({"a": _synced("a"), "b": _synced("b", stored=h)})
    first = picker.choose(workers, "prefill", prompt + [7])
    assert (first.worker.name, first.how, first.estimated) == ("b", "cache", 32 * BS)
    first.done(32 * BS)
    again = picker.choose(workers, "prefill", prompt + [8])
    assert again.worker.name == "b"
    # while `again` is in flight, a prompt that b holds half of: b's queue makes a the cheaper replica
    half = prompt[: 16 * BS] + list(range(5000, 5000 + 16 * BS))
    assert picker.choose(workers, "prefill", half).worker.name == "b"  # b: 256 + 1 + 64 queued < 513
    assert picker.choose(workers, "prefill", half).worker.name == "a"  # b's queue grew past a's cost


def test_new_prompts_spread_and_a_busy_replica_is_balanced_away():
    picker, workers = _picker({"a": _synced("a"), "b": _synced("b")}, balance_abs_threshold=2)
    picks = [picker.choose(workers, "prefill", list(range(i * 1000, i * 1000 + 300))) for i in range(1, 5)]
    assert [c.how for c in picks] == ["spread"] * 4
    assert sorted(c.worker.name for c in picks) == ["a", "a", "b", "b"]
    h = block_hashes(list(range(1, 1 + 20 * BS)), BS)
    picker, workers = _picker({"a": _synced("a", stored=h), "b": _synced("b")}, balance_abs_threshold=2)
    workers[0].inflight = 3
    c = picker.choose(workers, "prefill", list(range(1, 2 + 20 * BS)))
    assert (c.worker.name, c.how) == ("b", "balance")


def test_a_stale_view_or_a_full_cache_changes_the_pick():
    h = block_hashes(list(range(1, 1 + 20 * BS)), BS)
    full = CacheLoad(unfinished=4, blocks_free=1, blocks_total=100)
    picker, workers = _picker({"a": _synced("a", stored=h, load=full), "b": _synced("b")})
    assert picker.choose(workers, "prefill", list(range(1, 2 + 20 * BS))).worker.name == "b"  # a is full
    picker.cache.follower.indexes["b"].seen -= 60  # nothing heard from b for a minute
    c = picker.choose(workers, "prefill", list(range(1, 2 + 20 * BS)))
    assert c.how == "fallback" and c.worker.name == picker._by_hash(workers, list(range(1, 2 + 20 * BS))).name


def test_least_loaded_ties_go_round_every_worker():
    """Idle workers take turns, for two workers as for three (a tie-break that moved in steps of the
    worker count would send every pick to the same one)."""
    for n in (2, 3):
        workers = [SimpleNamespace(name=f"prefill-{i}", inflight=0) for i in range(n)]
        picker = Picker(RouterSection(policy="least_loaded"), BS)
        picks = [picker.pick(workers, "prefill", [1] * 64).name for _ in range(2 * n)]
        assert sorted(picks) == sorted([w.name for w in workers] * 2), picks
