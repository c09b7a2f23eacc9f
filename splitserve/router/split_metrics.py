"""The split's own metrics: whether a disaggregated deployment is disaggregating, per worker, from
each worker's /stats at scrape time (the same facts `splitserve verify` checks on its probes):

    splitserve:prompt_tokens_computed   prompt tokens a worker ran through its model (prefix-cache
                                        hits and imported KV excluded): the prefill pool's should
                                        grow; a decode worker's grows only when it prefills itself
    splitserve:kv_recomputed_tokens     prompt tokens of handed-off requests a decode worker computed
                                        again because their KV did not arrive (policy recompute)
    splitserve:kv_imported_tokens       prompt tokens whose KV a decode worker received
    splitserve:kv_fetched_bytes         bytes its transport fetched (the run-time probes' included)
    splitserve:kv_layout_bytes_per_token  the KV layout's bytes per token (block bytes / block size):
                                        a handoff moves whole blocks, so fetched bytes per imported
                                        token below this mean KV went missing

deploy/prometheus/alerts.yaml alerts on each (decode-side prompt recomputation, the prefill pool
idle while decode workers prefill, bytes per handed-off token below the layout's).
"""

from __future__ import annotations

from collections.abc import Callable

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.wire.stats import WorkerStats

Advance = Callable[[Counter, tuple[str, ...], int], None]


class SplitMetrics:
    def __init__(self, registry: CollectorRegistry, labels: list[str]) -> None:
        lab = [*labels, "worker", "role"]
        r = registry
        self.prompt_computed = Counter(
            "splitserve:prompt_tokens_computed", "Prompt tokens a worker computed", lab, registry=r
        )
        self.recomputed = Counter(
            "splitserve:kv_recomputed_tokens",
            "Prompt tokens of handed-off requests a decode worker recomputed (their KV did not arrive)",
            lab,
            registry=r,
        )
        self.imported = Counter(
            "splitserve:kv_imported_tokens",
            "Prompt tokens whose KV a decode worker received",
            lab,
            registry=r,
        )
        self.fetched = Counter(
            "splitserve:kv_fetched_bytes", "Bytes a worker's KV transport fetched", lab, registry=r
        )
        self.per_token = Gauge(
            "splitserve:kv_layout_bytes_per_token",
            "KV bytes per token of the worker's layout",
            lab,
            registry=r,
        )

    def prime(self, lab: tuple[str, ...]) -> None:
        """A worker's counters at 0 (router/metrics.py's NOTE: `increase()` sees the first event)."""
        for c in (self.prompt_computed, self.recomputed, self.imported, self.fetched):
            c.labels(*lab)

    def observe(self, stats: WorkerStats, lab: tuple[str, ...], advance: Advance) -> None:
        """One worker's /stats: its running totals into the counters (`advance`: RouterMetrics')."""
        advance(self.prompt_computed, lab, stats.prompt_tokens_computed)
        kv = stats.kv_transfer
        counts = kv.counts if kv is not None else {}
        advance(self.recomputed, lab, int(counts.get("recomputed_tokens", 0)))
        advance(self.imported, lab, int(counts.get("imported_tokens", 0)))
        transport = kv.transport if kv is not None else None  # the transport's self-description
        advance(self.fetched, lab, transport.counts.get("fetched_bytes", 0) if transport is not None else 0)
        if stats.kv_bytes_per_token:
            self.per_token.labels(*lab).set(stats.kv_bytes_per_token)


__all__ = ["SplitMetrics"]
