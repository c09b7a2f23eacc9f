"""Prometheus metrics of the router, named in vLLM's style (`splitserve:` prefix), on GET /metrics.

Per request: TTFT and its breakdown (queue on the prefill worker, prefill, KV transfer, first decode),
inter-token latency, end-to-end latency, KV-transfer seconds and bytes labelled by the backend that
actually moved them, requests by outcome. Per worker (read from the workers' /stats at scrape time):
running and waiting requests, KV-cache usage, up/restarts.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LATENCY = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
_ITL = (
    0.001,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
)
_BYTES = tuple(float(1 << k) for k in range(10, 34, 2))


class RouterMetrics:
    def __init__(self, model_name: str) -> None:
        self.registry = r = CollectorRegistry()
        self.model = model_name
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
        self.prompt_tokens = Counter("splitserve:prompt_tokens", "Prompt tokens processed", L, registry=r)
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
        queue, prefill, kv = m.get("queue_s"), m.get("prefill_s"), m.get("kv_fetch_s")
        if queue is not None:
            self.queue.labels(lab).observe(queue)
        if prefill is not None:
            self.prefill.labels(lab).observe(prefill)
        backend = m.get("kv_backend")
        if kv is not None and backend:
            self.kv_seconds.labels(lab, backend).observe(kv)
            self.kv_bytes.labels(lab, backend).inc(m.get("kv_bytes") or 0)
            self.kv_transfers.labels(lab, backend, "recomputed" if m.get("kv_error") else "ok").inc()
        known = sum(x for x in (queue, prefill, kv, m.get("kv_wait_s")) if x is not None)
        self.first_decode.labels(lab).observe(max(0.0, ttft - known))

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
    return headers


__all__ = ["RouterMetrics", "ttft_breakdown"]
