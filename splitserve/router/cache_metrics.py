"""Prometheus metrics of cache-aware routing (router.policy: cache_aware), on the router's GET /metrics.

- `splitserve:cache_routed{model_name, how}`: picks by how they were made: by the cache score ("cache"),
  a new prompt spread over the replicas ("spread"), the balance rule ("balance"), the hash policy while
  a view lags ("fallback");
- `splitserve:cache_estimated_hit_tokens{model_name, worker}`: prompt tokens the router expected cached;
- `splitserve:cache_actual_hit_tokens{model_name, worker}`: prompt tokens the worker found cached;
- `splitserve:cache_index_resyncs{model_name, worker, reason}`: views rebuilt from a snapshot or dropped;
- `splitserve:cache_index_blocks{model_name, worker}`: blocks in the router's view of the worker;
- `splitserve:cache_index_seq{model_name, worker}`: the last event applied (-1: no view);
- `splitserve:cache_index_fresh{model_name, worker}`: 1 while routing trusts the view.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.router.cache_index import ReplicaIndex

HOWS = ("cache", "spread", "balance", "fallback")
RESYNC_REASONS = ("start", "restart", "behind", "gap")  # ReplicaIndex.apply's


class CacheMetrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        w = ["model_name", "worker"]
        self.routed = Counter("splitserve:cache_routed", "Cache-aware picks by how they were made",
                              ["model_name", "how"], registry=registry)  # fmt: skip
        for how in HOWS:
            self.routed.labels(model, how)
        self.estimated = Counter("splitserve:cache_estimated_hit_tokens",
                                 "Prompt tokens the router expected the picked worker to find cached", w,
                                 registry=registry)  # fmt: skip
        self.actual = Counter("splitserve:cache_actual_hit_tokens",
                              "Prompt tokens the picked worker found in its prefix cache", w,
                              registry=registry)  # fmt: skip
        self.resyncs = Counter("splitserve:cache_index_resyncs",
                               "Router views of a worker's cache rebuilt from a snapshot or dropped",
                               ["model_name", "worker", "reason"], registry=registry)  # fmt: skip
        self.blocks = Gauge(
            "splitserve:cache_index_blocks",
            "Blocks in the router's view of a worker's cache",
            w,
            registry=registry,
        )
        self.seq = Gauge(
            "splitserve:cache_index_seq",
            "The last cache event of a worker the router applied",
            w,
            registry=registry,
        )
        self.fresh = Gauge(
            "splitserve:cache_index_fresh",
            "1 while routing trusts the view of a worker's cache",
            w,
            registry=registry,
        )

    def watch(self, index: ReplicaIndex, stale_s: float) -> None:
        """Gauges of `index`, read at scrape time; its worker's counters, at 0 from the start."""
        lab = (self.model, index.name)
        for reason in RESYNC_REASONS:
            self.resyncs.labels(*lab, reason)
        self.estimated.labels(*lab)
        self.actual.labels(*lab)
        self.blocks.labels(*lab).set_function(lambda: len(index.stored))
        self.seq.labels(*lab).set_function(lambda: index.seq)
        fresh: Callable[[], float] = lambda: float(index.fresh(time.monotonic(), stale_s))  # noqa: E731
        self.fresh.labels(*lab).set_function(fresh)

    def resynced(self, worker: str, reason: str) -> None:
        self.resyncs.labels(self.model, worker, reason).inc()

    def picked(self, how: str, worker: str, estimated: int) -> None:
        self.routed.labels(self.model, how).inc()
        self.estimated.labels(self.model, worker).inc(estimated)

    def found(self, worker: str, cached_tokens: int) -> None:
        self.actual.labels(self.model, worker).inc(cached_tokens)


__all__ = ["HOWS", "RESYNC_REASONS", "CacheMetrics"]
