"""Prometheus metrics of the router, named in vLLM's style (`splitserve:` prefix), on GET /metrics.

Per request: TTFT and its breakdown (queue on the prefill worker, prefill, KV transfer, first decode),
inter-token latency, time per output token and decode time, end-to-end latency, KV-transfer seconds and
bytes labelled by the backend that actually moved them, requests by outcome, answers by error status
(every 4xx and 5xx, counted by the access-log middleware). Per worker (read from the workers' /stats at
scrape time): running and waiting requests, KV-cache usage, preemptions, prefix-cache queries and hits,
up/restarts.

NOTE: every labelled counter is created at 0 for the labels it will carry (`prime`, and `prime_workers`
at each scrape for the workers and pairs known then), so that `increase()` in an alert sees the step
from 0 to 1 of the first event: a series born at 1 has no earlier sample to increase from.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from splitserve.router.split_metrics import SplitMetrics
from splitserve.wire.stats import WorkerRow

_LATENCY = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
            20.0, 40.0, 80.0)  # fmt: skip
_ITL = (0.001, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
        0.75, 1.0, 2.5)  # fmt: skip
_BYTES = tuple(float(1 << k) for k in range(10, 34, 2))
# the statuses the API answers with (openai_protocol.APIError's and starlette's)
ERROR_STATUSES = ("400", "401", "404", "405", "413", "422", "429", "499", "500", "502", "503", "504")
KV_FAILURE_KINDS = ("kv_transfer_failed", "kv_transfer_timeout", "kv_transport")
FINISH_REASONS = ("stop", "length", "abort")


class RouterMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model_name
        self._totals: dict[tuple[str, ...], int] = {}  # a worker counter's last total (`_advance`)
        L = ["model_name"]  # noqa: N806
        self.ttft = Histogram(
            "splitserve:time_to_first_token_seconds",
            "Time to first token, as the router saw it",
            L,
            buckets=_LATENCY,
            registry=r,
        )
        self.itl = Histogram(
            "splitserve:inter_token_latency_seconds",
            "Time between two output tokens",
            L,
            buckets=_ITL,
            registry=r,
        )
        self.e2e = Histogram(
            "splitserve:e2e_request_latency_seconds",
            "End-to-end request latency",
            L,
            buckets=_LATENCY,
            registry=r,
        )
        self.queue = Histogram(
            "splitserve:request_queue_time_seconds",
            "Time a request waited in a worker's queue before its prefill started",
            L,
            buckets=_LATENCY,
            registry=r,
        )
        self.router_queue = Histogram(
            "splitserve:router_queue_time_seconds",
            "Time a request waited in the router's bounded queue",
            L,
            buckets=_LATENCY,
            registry=r,
        )
        self.prefill = Histogram(
            "splitserve:request_prefill_time_seconds",
            "Prefill time on the worker",
            L,
            buckets=_LATENCY,
            registry=r,
        )
        self.first_decode = Histogram(
            "splitserve:request_first_decode_time_seconds",
            "TTFT minus queue, prefill and KV transfer: the decode join and the HTTP hops",
            L,
            buckets=_LATENCY,
            registry=r,
        )
        self.kv_seconds = Histogram(
            "splitserve:kv_transfer_seconds",
            "KV fetch time per request",
            [*L, "backend"],
            buckets=_LATENCY,
            registry=r,
        )
        self.kv_bytes = Counter("splitserve:kv_transfer_bytes", "KV bytes moved", [*L, "backend"], registry=r)
        self.kv_transfers = Counter(
            "splitserve:kv_transfers",
            "KV transfers by backend and outcome",
            [*L, "backend", "outcome"],
            registry=r,
        )
        self.requests = Counter(
            "splitserve:request_success",
            "Finished requests by finish reason",
            [*L, "finished_reason"],
            registry=r,
        )
        self.errors = Counter(
            "splitserve:request_errors",
            "Requests answered with an error, by status",
            [*L, "status"],
            registry=r,
        )
        self.tpot = Histogram(
            "splitserve:request_time_per_output_token_seconds",
            "Per request: (end-to-end - TTFT) / (output tokens - 1)",
            L,
            buckets=_ITL,
            registry=r,
        )
        self.decode_time = Histogram(
            "splitserve:request_decode_time_seconds",
            "Per request: end-to-end minus TTFT, the decode phase",
            L,
            buckets=_LATENCY,
            registry=r,
        )
        self.preemptions = Counter(
            "splitserve:num_preemptions", "Requests a worker preempted", [*L, "worker", "role"], registry=r
        )
        self.prefix_queries = Counter(
            "splitserve:prefix_cache_queries",
            "Prompt tokens looked up in a worker's prefix cache",
            [*L, "worker", "role"],
            registry=r,
        )
        self.prefix_hits = Counter(
            "splitserve:prefix_cache_hits",
            "Prompt tokens a worker's prefix cache served",
            [*L, "worker", "role"],
            registry=r,
        )
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens processed", L, registry=r)
        self.split = SplitMetrics(r, L)  # is the deployment disaggregating? (split_metrics.py)
        self.generation_tokens = Counter("splitserve:generation_tokens", "Tokens generated", L, registry=r)
        self.running = Gauge(
            "splitserve:num_requests_running",
            "Requests running on a worker",
            [*L, "worker", "role"],
            registry=r,
        )
        self.waiting = Gauge(
            "splitserve:num_requests_waiting",
            "Requests waiting on a worker",
            [*L, "worker", "role"],
            registry=r,
        )
        self.kv_usage = Gauge(
            "splitserve:kv_cache_usage_perc",
            "Fraction of a worker's KV blocks in use",
            [*L, "worker", "role"],
            registry=r,
        )
        self.kv_blocks_held = Gauge(
            "splitserve:kv_blocks_held",
            "KV blocks a worker keeps out of use because a GPU copy of a failed fetch may still write them",
            [*L, "worker", "role"],
            registry=r,
        )
        self.worker_up = Gauge(
            "splitserve:worker_up", "1 while a worker is ready", [*L, "worker", "role"], registry=r
        )
        self.worker_restarts = Counter(
            "splitserve:worker_restarts", "Worker restarts", [*L, "worker", "role"], registry=r
        )
        self.kv_backend = Gauge(
            "splitserve:kv_backend_info",
            "1 for the KV backend a worker actually runs",
            [*L, "worker", "role", "backend", "requested"],
            registry=r,
        )
        self.kv_fallbacks = Gauge(
            "splitserve:kv_transport_fallbacks",
            "Fallbacks a worker's transport took",
            [*L, "worker", "role"],
            registry=r,
        )
        self.kv_failures = Counter(
            "splitserve:kv_transfer_failures",
            "KV transfers that failed, by kind",
            [*L, "backend", "kind"],
            registry=r,
        )
        self.kv_backend_ok = Gauge(
            "splitserve:kv_backend_ok",
            "1 when the backend a worker runs is one the manifest requires",
            [*L, "worker", "role"],
            registry=r,
        )
        self.kv_probe_gbps = Gauge(
            "splitserve:kv_probe_gbps",
            "Last run-time KV probe bandwidth of a pair",
            [*L, "prefill", "decode", "backend"],
            registry=r,
        )
        self.kv_probe_failures = Counter(
            "splitserve:kv_probe_failures",
            "Run-time KV probes that failed",
            [*L, "prefill", "decode"],
            registry=r,
        )
        self.kv_bandwidth_low = Gauge(
            "splitserve:kv_bandwidth_low",
            "1 when a pair's last probe was below verify.min_gbps",
            [*L, "prefill", "decode"],
            registry=r,
        )
        self.kv_min_gbps = Gauge(
            "splitserve:kv_min_gbps", "The manifest's KV bandwidth floor (verify.min_gbps)", L, registry=r
        )
        self.load_seconds = Gauge(
            "splitserve:worker_weight_load_seconds",
            "A worker's last weight load, by stage (open, read, convert, cache_write, "
            "verify, copy, warmup; total)",
            [*L, "worker", "role", "stage"],
            registry=r,
        )
        self.weight_cache = Gauge(
            "splitserve:worker_weight_cache_info",
            "1 for how a worker's weights were loaded (cache status and method)",
            [*L, "worker", "role", "status", "method"],
            registry=r,
        )
        self.startup_seconds = Gauge(
            "splitserve:worker_startup_seconds",
            "A worker's last start, spawn to ready",
            [*L, "worker", "role"],
            registry=r,
        )
        self.router_running = Gauge(
            "splitserve:router_requests_running", "Requests in flight in the router", L, registry=r
        )
        self.router_waiting = Gauge(
            "splitserve:router_requests_waiting",
            "Requests waiting in the router's bounded queue",
            L,
            registry=r,
        )

    def observe_first(self, ttft: float, m: dict) -> None:
        """The first piece of a choice arrived: TTFT and its breakdown (m: the workers' metrics)."""
        lab = self.model
        self.ttft.labels(lab).observe(ttft)
        queue, prefill, kv_fetch = m.get("queue_s"), m.get("prefill_s"), m.get("kv_fetch_s")
        if queue is not None:
            self.queue.labels(lab).observe(queue)
        if prefill is not None:
            self.prefill.labels(lab).observe(prefill)
        self.observe_transfer(m)
        known = sum(x for x in (queue, prefill, kv_fetch, m.get("kv_wait_s")) if x is not None)
        self.first_decode.labels(lab).observe(max(0.0, ttft - known))

    def observe_transfer(self, m: dict) -> None:
        """A KV transfer, as the decode worker's first line reports it (m: the workers' metrics): the
        choice's first piece, or a later one when the first token went ahead (`router.first_token`)."""
        backend, kv_fetch, lab = m.get("kv_backend"), m.get("kv_fetch_s"), self.model
        if kv_fetch is not None and backend:
            self.kv_seconds.labels(lab, backend).observe(kv_fetch)
            self.kv_bytes.labels(lab, backend).inc(m.get("kv_bytes") or 0)
            self.kv_transfers.labels(lab, backend, "recomputed" if m.get("kv_error") else "ok").inc()

    def observe_done(self, e2e: float, ttft: float | None, output_tokens: int) -> None:
        """A request finished: its decode time and time per output token (TPOT)."""
        self.e2e.labels(self.model).observe(e2e)
        if ttft is None:
            return
        decode = max(0.0, e2e - ttft)
        self.decode_time.labels(self.model).observe(decode)
        if output_tokens > 1:
            self.tpot.labels(self.model).observe(decode / (output_tokens - 1))

    def prime(self, backend: str) -> None:
        """The label sets known from the start, at 0 (see the module's NOTE)."""
        lab = self.model
        for status in ERROR_STATUSES:
            self.errors.labels(lab, status)
        for reason in FINISH_REASONS:
            self.requests.labels(lab, reason)
        for kind in KV_FAILURE_KINDS:
            self.kv_failures.labels(lab, backend, kind)
        for outcome in ("ok", "recomputed"):
            self.kv_transfers.labels(lab, backend, outcome)
        self.kv_bytes.labels(lab, backend)
        for c in (self.prompt_tokens, self.generation_tokens):
            c.labels(lab)

    def prime_workers(self, workers: list[dict]) -> None:
        """Per-worker and per-pair counters at 0 for the workers known now (name and role each)."""
        lab = self.model
        for w in workers:
            for c in (self.worker_restarts, self.preemptions, self.prefix_queries, self.prefix_hits):
                c.labels(lab, w["name"], w["role"])
            self.split.prime((lab, w["name"], w["role"]))
        for p in (w for w in workers if w["role"] == "prefill"):
            for d in (w for w in workers if w["role"] == "decode"):
                self.kv_probe_failures.labels(lab, p["name"], d["name"])

    def from_worker_stats(self, rows: list[WorkerRow], required: list[str]) -> None:
        """Gauges (and counters, by their increase since the last scrape) from each worker's /stats."""
        for row in rows:
            lab = (self.model, row.worker, row.role)
            self.worker_up.labels(*lab).set(1 if row.up else 0)
            s = row.stats
            if s is None:
                continue
            self.running.labels(*lab).set(s.running)
            self.waiting.labels(*lab).set(s.waiting)
            usage = row.usage()
            if usage is not None:
                self.kv_usage.labels(*lab).set(usage)
                self.kv_blocks_held.labels(*lab).set(s.blocks.held)
            self._advance(self.preemptions, lab, s.preemptions)
            self._advance(self.prefix_queries, lab, s.prefix_cache.queries)
            self._advance(self.prefix_hits, lab, s.prefix_cache.hits)
            self.split.observe(s, lab, self._advance)
            transfer = s.kv_transfer
            if transfer is not None and transfer.backend:
                backend = transfer.backend
                self.kv_backend_ok.labels(*lab).set(1 if backend in required else 0)
                tr = transfer.transport  # the transport's self-description
                self.kv_backend.labels(*lab, backend, tr.requested if tr is not None else backend).set(1)
                self.kv_fallbacks.labels(*lab).set(tr.counts.get("fallbacks", 0) if tr is not None else 0)

    def _advance(self, counter: Counter, lab: tuple[str, ...], total: int) -> None:
        """A worker's running total into a counter: the increase since the last scrape (a restarted
        worker starts again from 0, so then the whole total is new)."""
        key = (counter._name, *lab)
        last = self._totals.get(key, 0)
        counter.labels(*lab).inc(total - last if total >= last else total)
        self._totals[key] = total

    def render(self) -> bytes:
        return generate_latest(self.registry)


def ttft_breakdown(ttft: float, m: dict) -> dict[str, str]:
    """Response headers: where the first token's time went, milliseconds."""
    parts = {
        "queue": m.get("queue_s"),
        "prefill": m.get("prefill_s"),
        "transfer": None if m.get("kv_fetch_s") is None else m["kv_fetch_s"] + (m.get("kv_wait_s") or 0.0),
    }
    known = sum(v for v in parts.values() if v is not None)
    parts["first-decode"] = max(0.0, ttft - known)
    headers = {"x-splitserve-ttft-ms": f"{ttft * 1e3:.2f}"}
    for name, value in parts.items():
        if value is not None:
            headers[f"x-splitserve-ttft-{name}-ms"] = f"{value * 1e3:.2f}"
    if m.get("kv_backend"):
        headers["x-splitserve-kv-backend"] = str(m["kv_backend"])
    if m.get("prefill_worker"):  # which replica ran the prompt (cache-aware routing shows here)
        headers["x-splitserve-prefill-worker"] = str(m["prefill_worker"])
    return headers


__all__ = ["RouterMetrics", "ttft_breakdown"]
