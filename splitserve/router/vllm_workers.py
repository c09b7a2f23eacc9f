"""vLLM's scheduler, cache and speculative-decoding series of every worker, on the router's /metrics
(router/vllm_metrics.py has the request series; docs/metrics.md the table).

Each worker's GET /stats is read when the metrics snapshot is taken; every series carries `model_name`,
`worker` and `role`, so `sum(...)` is the deployment's figure and `sum by (role)` a pool's. A worker's
counters are its running totals: the series here add what each snapshot grew by (a restarted worker
starts again from 0), so they stay monotonic as Prometheus expects.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.metrics_core import HistogramMetricFamily, Metric

from splitserve.wire.stats import STEP_TOKEN_BUCKETS, WorkerRow, WorkerStats

W = ["model_name", "worker", "role"]


class VllmWorkerMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        r, self.model = registry, model_name

        def gauge(name: str, doc: str, labels: list[str] = W) -> Gauge:
            return Gauge(f"vllm:{name}", doc, labels, registry=r)

        def counter(name: str, doc: str, labels: list[str] = W) -> Counter:
            return Counter(f"vllm:{name}", doc, labels, registry=r)

        self.running = gauge("num_requests_running", "Number of requests in model execution batches.")
        self.waiting = gauge("num_requests_waiting", "Number of requests waiting to be processed.")
        self.kv_usage = gauge("kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.")
        self.gpu_usage = gauge("gpu_cache_usage_perc", "KV-cache usage (the older name).")
        self.cache_config = gauge(
            "cache_config_info",
            "Information of the LLMEngine CacheConfig",
            [*W, "block_size", "num_gpu_blocks", "enable_prefix_caching"],
        )
        self.preemptions = counter("num_preemptions", "Cumulative number of preemption from the engine.")
        self.prefix_queries = counter(
            "prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens."
        )
        self.prefix_hits = counter(
            "prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens."
        )
        self.drafts = counter("spec_decode_num_drafts", "Number of spec decoding drafts.")
        self.draft_tokens = counter("spec_decode_num_draft_tokens", "Number of draft tokens.")
        self.accepted = counter("spec_decode_num_accepted_tokens", "Number of accepted tokens.")
        self.accepted_per_pos = counter(
            "spec_decode_num_accepted_tokens_per_pos",
            "Accepted tokens per draft position.",
            [*W, "position"],
        )
        self._totals: dict[tuple[str, str], list[int]] = {}  # per worker: its totals at the last snapshot
        self._steps: dict[tuple[str, str], list[int]] = {}  # per worker: step counts per bucket, sum

    def update(self, rows: list[WorkerRow]) -> None:
        """The figures of every worker that answered its /stats (a worker that is down has no row)."""
        for row in rows:
            if row.stats is not None:
                self._one(row, row.stats)

    def _one(self, row: WorkerRow, s: WorkerStats) -> None:
        key = (row.worker, row.role)
        lab = (self.model, *key)
        self.running.labels(*lab).set(s.running)
        self.waiting.labels(*lab).set(s.waiting)
        usage = row.usage() or 0.0
        self.kv_usage.labels(*lab).set(usage)
        self.gpu_usage.labels(*lab).set(usage)
        prefix, total = s.prefix_cache, s.blocks.total
        self.cache_config.labels(*lab, str(s.block_size), str(total), str(prefix.enabled)).set(1)
        steps, spec = s.iteration_tokens, s.spec_decode
        per_pos = list(spec.accepted_per_pos) if spec is not None else []
        drafts = (spec.num_drafts, spec.num_draft_tokens, spec.num_accepted_tokens) if spec else (0, 0, 0)
        counters = [self.preemptions, self.prefix_queries, self.prefix_hits, self.drafts, self.draft_tokens,
                    self.accepted]  # fmt: skip
        totals = [s.preemptions, prefix.queries, prefix.hits, *drafts, *per_pos, *steps.counts, steps.sum]
        new = self._increase(key, totals)
        for counter, inc in zip(counters, new, strict=False):
            counter.labels(*lab).inc(inc)
        head = len(counters)
        for pos, inc in enumerate(new[head : head + len(per_pos)]):
            self.accepted_per_pos.labels(*lab, str(pos)).inc(inc)
        step_new = new[head + len(per_pos) :]
        acc = self._steps.setdefault(key, [0] * len(step_new))
        for i, inc in enumerate(step_new):
            acc[i] += inc

    def _increase(self, worker: tuple[str, str], totals: list[int]) -> list[int]:
        """A worker's running totals -> what they grew by since the last snapshot. Any total below its
        last value means the worker restarted (from 0): then every total is new."""
        last = self._totals.get(worker)
        self._totals[worker] = totals
        if last is None or len(last) != len(totals) or any(n < o for n, o in zip(totals, last, strict=True)):
            return list(totals)
        return [n - o for n, o in zip(totals, last, strict=True)]

    def step_families(self) -> Iterator[Metric]:
        """vllm:iteration_tokens_total, one histogram per worker, from the step counts gathered."""
        fam = HistogramMetricFamily(
            "vllm:iteration_tokens_total", "Histogram of number of tokens per engine_step.", labels=W
        )
        for (worker, role), acc in sorted(self._steps.items()):
            cumulative, running = [], 0
            for bound, count in zip([*STEP_TOKEN_BUCKETS, "+Inf"], acc[:-1], strict=True):
                running += count
                cumulative.append((str(float(bound)) if bound != "+Inf" else bound, running))
            fam.add_metric([self.model, worker, role], cumulative, acc[-1])
        yield fam


__all__ = ["VllmWorkerMetrics"]
