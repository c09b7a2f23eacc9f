"""Cache-aware routing (router.policy: cache_aware) on a real deployment: two prefill replicas and one
decode worker of the default model, real processes and HTTP. The router's view of each replica follows
the replica's own prefix-cache events (GET /kv/events), routing goes where a prompt's prefix is cached,
load wins over the cache when a replica is busy, a replica whose events stop is routed by the hash
policy until its events come back, and a restarted replica's view is rebuilt from a snapshot.

The KV caches are small (96 MB: about 136 blocks of 16 tokens), so that a few long prompts evict."""

from __future__ import annotations

import os
import random
import re
import signal
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import httpx
import msgspec
import pytest
from serve_harness import MODEL, SECRET, manifest_yaml, start_deployment

from splitserve.config.manifest_sections import RouterSection
from splitserve.router.cache_index import ReplicaIndex
from splitserve.router.dispatch import Picker
from splitserve.wire.auth import worker_headers
from splitserve.wire.kv_events import KVEventsPage, block_hashes

BLOCK = 16
ROUTER = {"policy": "cache_aware", "cache_aware": {"poll_wait_s": 0.3, "stale_s": 1.0}}


@pytest.fixture(scope="module")
def dep():
    d = start_deployment(
        manifest_yaml(
            mode="disaggregated",
            model={"max_model_len": 1024},
            engine={"kv_cache_mb": 96, "max_num_seqs": 32},
            prefill={"replicas": 2},
            router=ROUTER,
            runtime={"health_interval_s": 1.0},
        )  # fmt: skip
    )
    yield d
    assert d.stop() == 0, "\n".join(d.log)


_rng = random.Random(5)


def ids(n: int) -> list[int]:
    return [_rng.randint(3, 30000) for _ in range(n)]


def complete(dep, prompt: list[int]) -> str:
    """One request; -> the prefill replica that ran it."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{dep.url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-splitserve-prefill-worker"]


def metric(dep, name: str, **labels: str) -> float:
    """A series of the router's /metrics (a snapshot of at most a second ago)."""
    text = httpx.get(f"{dep.url}/metrics", timeout=30).text
    for line in text.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"{name} {labels} not in /metrics")


def page(url: str, epoch: str = "", after: int = -1) -> KVEventsPage:
    r = httpx.get(f"{url}/kv/events", params={"epoch": epoch, "after": after}, headers=worker_headers(SECRET))
    assert r.status_code == 200, r.text
    return msgspec.json.decode(r.content, type=KVEventsPage)


def until(check, timeout_s: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def prefill_urls(dep) -> dict[str, str]:
    return {n: u for n, u in dep.worker_urls().items() if n.startswith("prefill")}


def test_views_follow_each_replicas_events_through_evictions(dep):
    urls = prefill_urls(dep)
    starts = {n: page(u) for n, u in urls.items()}  # a snapshot each, then its events
    views = {}
    for n, p in starts.items():
        views[n] = ReplicaIndex(n)
        assert views[n].apply(p, time.monotonic()) == "start"
    total = max(s["blocks"]["total"] for n, s in dep.worker_stats().items() if n in urls)
    prompts = [ids(512) for _ in range(2 * (total // 32) + 2)]  # 32 blocks each: more than both caches hold
    ran = [complete(dep, p) for p in prompts]
    removed, stored = Counter(), {}
    for n, u in urls.items():
        events = page(u, starts[n].epoch, starts[n].seq)
        assert events.snapshot is None and events.events, n
        removed[n] = sum(len(e.hashes) for e in events.events if e.kind == "removed")
        stored[n] = {h for e in events.events if e.kind == "stored" for h in e.hashes}
        assert views[n].apply(events, time.monotonic()) is None
        now = page(u)  # the worker's own snapshot, as of the same seq
        assert now.seq == views[n].seq and set(now.snapshot.stored) == views[n].stored, n
        seq = now.seq
        until(
            lambda n=n, seq=seq: metric(dep, "splitserve:cache_index_seq", worker=n) == seq,
            what=f"{n}'s view",
        )
        assert metric(dep, "splitserve:cache_index_blocks", worker=n) == len(now.snapshot.stored)
    assert sum(removed.values()) > 0, "nothing was evicted: the test's prompts no longer fill the caches"
    for prompt, name in zip(prompts, ran, strict=True):  # the router's hash chain is the engine's
        hashes = block_hashes(prompt, BLOCK, (len(prompt) - 1) // BLOCK)
        assert set(hashes) <= stored[name], name


def test_a_prompt_goes_where_its_prefix_is_cached(dep):
    system = ids(384)
    first = complete(dep, system + ids(16))
    time.sleep(1.2)  # the view has the blocks the prefill stored, /metrics has its counts (1 s snapshots)
    est0 = metric(dep, "splitserve:cache_estimated_hit_tokens_total", worker=first)
    act0 = metric(dep, "splitserve:cache_actual_hit_tokens_total", worker=first)
    ran = [complete(dep, system + ids(16)) for _ in range(4)]
    assert ran == [first] * 4

    def counted() -> tuple[float, float]:
        est = metric(dep, "splitserve:cache_estimated_hit_tokens_total", worker=first) - est0
        return est, metric(dep, "splitserve:cache_actual_hit_tokens_total", worker=first) - act0

    # the 24 whole blocks of the system prompt, each time, expected by the router and found by the worker
    until(lambda: counted() == (4 * 384, 4 * 384), what="the estimated and actual hits")


def test_load_wins_over_the_cache_on_a_busy_replica(dep):
    system = ids(256)
    holder = complete(dep, system + ids(256))
    time.sleep(0.8)  # the view has its blocks
    assert complete(dep, system + ids(256)) == holder  # alone: the replica with the prefix
    with ThreadPoolExecutor(8) as pool:
        ran = list(pool.map(lambda _: complete(dep, system + ids(256)), range(8)))
    assert set(ran) == set(prefill_urls(dep)), f"all on one replica although the other was idle: {ran}"


def test_a_replica_whose_events_stop_is_routed_by_the_hash_policy(dep):
    workers = {w["name"]: w for w in dep.admin()["workers"] if w["role"] == "prefill"}
    stopped, other = sorted(workers)
    until(lambda: metric(dep, "splitserve:cache_index_fresh", worker=stopped) == 1, what="a fresh view")
    picker = Picker(RouterSection(policy="prefix_affinity"), BLOCK)
    ends = [SimpleNamespace(name=n, inflight=0) for n in sorted(workers)]
    prompt = next(p for p in (ids(300) for _ in range(64)) if picker.pick(ends, "prefill", p).name == other)
    fallback0 = metric(dep, "splitserve:cache_routed_total", how="fallback")
    os.kill(workers[stopped]["pid"], signal.SIGSTOP)
    try:
        until(lambda: metric(dep, "splitserve:cache_index_fresh", worker=stopped) == 0, what="a stale view")
        assert complete(dep, prompt) == other
        until(lambda: metric(dep, "splitserve:cache_routed_total", how="fallback") == fallback0 + 1,
              what="the pick counted as a fallback")  # fmt: skip
    finally:
        os.kill(workers[stopped]["pid"], signal.SIGCONT)
    until(lambda: metric(dep, "splitserve:cache_index_fresh", worker=stopped) == 1, what="the view back")


def test_a_restarted_replica_is_resynced_from_a_snapshot(dep):
    workers = {w["name"]: w for w in dep.admin()["workers"] if w["role"] == "prefill"}
    name = sorted(workers)[0]
    until(lambda: metric(dep, "splitserve:cache_index_blocks", worker=name) > 0, what="a view with blocks")
    restarts0 = metric(dep, "splitserve:cache_index_resyncs_total", worker=name, reason="restart")
    os.kill(workers[name]["pid"], signal.SIGKILL)
    until(lambda: metric(dep, "splitserve:cache_index_resyncs_total", worker=name, reason="restart")
          == restarts0 + 1, timeout_s=60, what="the restarted worker's snapshot")  # fmt: skip
    until(lambda: metric(dep, "splitserve:cache_index_blocks", worker=name) == 0, what="an empty view")
    until(lambda: metric(dep, "splitserve:cache_index_fresh", worker=name) == 1, what="a fresh view")
    assert re.match(r"prefill-\d", complete(dep, ids(200)))
