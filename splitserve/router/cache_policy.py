"""Cache-aware routing (router.policy: cache_aware): the replica that would find the most of the prompt in
its prefix cache, weighed against the work already queued there, as SGLang's cache-aware router, llm-d's
precise prefix-cache scorer and Dynamo's KV router do, fed by the replicas' own cache events
(cache_follow.py keeps a view per replica, cache_index.py).

The pick, over the ready replicas of the role (knobs: `router.cache_aware`, config/manifest_routing.py):
  1. any replica whose view is not fresh (no snapshot yet, a gap, a restart being resynced, nothing heard
     for `stale_s`): the hash policy (prefix_affinity) picks, counted as "fallback";
  2. replicas whose KV usage is above `kv_usage_limit` are left out while another is below it;
  3. balance (SGLang's rule): when the busiest has more than `balance_abs_threshold` requests in flight
     over the least busy and more than `balance_rel_threshold` times as many, the least busy, "balance";
  4. a new prompt: when no replica holds `cache_threshold` of the prompt's leading blocks, the least
     queued, then the one with the smallest cache (fewest blocks in its view), "spread": new prefixes
     spread over the replicas rather than pile up where a short common preamble is cached;
  5. else the lowest cost, "cache":
         hit  = usable cached prefix tokens  (+ hybrid_kv_credit x cached tokens past the last checkpoint)
         cost = (prompt tokens - hit) + load_weight x queued
         queued = sum over the router's requests in flight there of (their estimated tokens to compute
                  + request_tokens)
     ties go to the less queued, then to the replica picked fewer times (so that new prompts spread).
The estimate is counted against the hit the worker reports (`Timings.cached_tokens`) in cache_metrics.py.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from splitserve.config.manifest_sections import RouterSection
from splitserve.router.cache_follow import CacheFollower
from splitserve.router.cache_index import ReplicaIndex
from splitserve.router.cache_metrics import CacheMetrics
from splitserve.router.worker_answers import WorkerEndpoint
from splitserve.wire.kv_events import block_hashes


@dataclass
class Choice:
    """A pick: the worker, the prompt tokens expected cached there, how it was made, and the queued work
    it adds until `done()`."""

    worker: WorkerEndpoint
    estimated: int = 0
    how: str = "cache"
    queued: int = 0
    _policy: CacheAwarePolicy | None = None

    def done(self, cached_tokens: int | None = None) -> None:
        """The prefill answered (or failed): its queued work is gone. `cached_tokens`: the prompt tokens the
        worker found cached."""
        policy, self._policy = self._policy, None
        if policy is None:
            return
        policy.queued[self.worker.name] -= self.queued
        if cached_tokens is not None and policy.metrics is not None:
            policy.metrics.found(self.worker.name, cached_tokens)


class CacheAwarePolicy:
    def __init__(self, config: RouterSection, block_size: int, follower: CacheFollower) -> None:
        self.router = config
        self.config = config.cache_aware
        self.block_size = block_size
        self.follower = follower
        self.metrics: CacheMetrics | None = None
        self.queued: Counter[str] = Counter()  # tokens of prefill work in flight per replica (estimated)
        self.picks: Counter[str] = Counter()

    def choose(
        self,
        workers: Sequence[WorkerEndpoint],
        prompt_ids: Sequence[int],
        by_hash: Callable[[Sequence[WorkerEndpoint], Sequence[int]], WorkerEndpoint],
    ) -> Choice:
        now = time.monotonic()
        if not all(self.follower.fresh(w.name, now) for w in workers):
            return self._chosen(Choice(by_hash(workers, prompt_ids), how="fallback"), len(prompt_ids))
        indexes = [self.follower.indexes[w.name] for w in workers]
        roomy = [i for i, idx in enumerate(indexes) if idx.kv_usage() < self.config.kv_usage_limit]
        pool = roomy or list(range(len(workers)))
        least = min(pool, key=lambda i: (workers[i].inflight, self.picks[workers[i].name]))
        busiest = max(workers[i].inflight for i in pool)
        low = workers[least].inflight
        c = self.config
        if busiest - low > c.balance_abs_threshold and busiest > c.balance_rel_threshold * low:
            _, hit = self._hit(indexes[least], prompt_ids)
            return self._chosen(Choice(workers[least], hit, "balance"), len(prompt_ids))
        bs = indexes[0].block_size or self.block_size
        hashes = block_hashes(prompt_ids, bs, (len(prompt_ids) - 1) // bs)
        matched = max(indexes[i].match(hashes)[0] for i in pool) * bs
        if matched < c.cache_threshold * len(prompt_ids):
            i = min(pool, key=lambda i: (self.queued[workers[i].name], len(indexes[i].stored),
                                         self.picks[workers[i].name], workers[i].name))  # fmt: skip
            _, hit = self._hit(indexes[i], prompt_ids, hashes)
            return self._chosen(Choice(workers[i], hit, "spread"), len(prompt_ids))
        best, best_key, best_hit = pool[0], None, 0
        for i in pool:
            w, (hit, skipped) = workers[i], self._hit(indexes[i], prompt_ids, hashes)
            queued = self.queued[w.name]
            key = (len(prompt_ids) - hit + c.load_weight * queued, queued, self.picks[w.name], w.name)
            if best_key is None or key < best_key:
                best, best_key, best_hit = i, key, skipped
        return self._chosen(Choice(workers[best], best_hit, "cache"), len(prompt_ids))

    def _hit(self, idx: ReplicaIndex, prompt_ids: Sequence[int], hashes: list[bytes] | None = None
             ) -> tuple[float, int]:  # fmt: skip
        """(the hit the cost counts: usable tokens, and for a hybrid model part of those past its last
        checkpoint; the prompt tokens the replica is expected to skip)."""
        bs = idx.block_size or self.block_size
        if hashes is None:
            hashes = block_hashes(prompt_ids, bs, (len(prompt_ids) - 1) // bs)
        kv, usable = idx.match(hashes)
        return bs * (usable + self.config.hybrid_kv_credit * (kv - usable)), bs * usable

    def _chosen(self, choice: Choice, prompt_len: int) -> Choice:
        name = choice.worker.name
        choice.queued = max(0, prompt_len - choice.estimated) + self.config.request_tokens
        choice._policy = self
        self.queued[name] += choice.queued
        self.picks[name] += 1
        if self.metrics is not None:
            self.metrics.picked(choice.how, name, choice.estimated)
        return choice


__all__ = ["CacheAwarePolicy", "Choice"]
