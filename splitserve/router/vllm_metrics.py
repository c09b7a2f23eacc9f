"""vLLM's own metric names on the router's /metrics, so dashboards, autoscaling rules (HPA, KEDA) and
alerts written for vLLM find their series at the one endpoint (docs/metrics.md has the table).

Request-level figures (latencies, token counts, request parameters, the KV transfer before a
disaggregated request's first token under NIXL's names) are observed by the router as each request
runs, under vLLM's names and bucket bounds (vllm/v1/metrics/loggers.py). Scheduler figures are every
worker's (router/vllm_workers.py), one series per worker (labels `worker` and `role`), so
`sum(vllm:num_requests_waiting)` is the deployment's queue. The router's own bounded queue is one more
series of `vllm:num_requests_waiting` (worker="router"): requests queued there wait for the deployment
just as those in an engine's queue do.

`vllm:time_per_output_token_seconds` (vLLM's older name of the inter-token latency) is rendered as a
copy of `vllm:inter_token_latency_seconds`, so each token is observed once.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric

from splitserve.router.vllm_workers import VllmWorkerMetrics
from splitserve.wire.stats import WorkerRow

TTFT_BUCKETS = (
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
    160.0,
    640.0,
    2560.0,
)
ITL_BUCKETS = (
    0.01,
    0.025,
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
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
REQUEST_BUCKETS = (
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
    1920.0,
    7680.0,
)
N_BUCKETS = (1, 2, 5, 10, 20)
KV_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
KV_BYTES_BUCKETS = tuple(2 ** (10 + i) for i in range(1, 25, 2))  # 2 KiB to 8 GiB
FINISHED_REASONS = ("stop", "length", "abort")


def buckets_1_2_5(limit: int) -> tuple[int, ...]:
    """1, 2, 5, 10, 20, 50, ... up to `limit` (vLLM's build_1_2_5_buckets)."""
    out, base = [], 1
    while True:
        for m in (1, 2, 5):
            if base * m > limit:
                return tuple(out)
            out.append(base * m)
        base *= 10


class VllmMetrics:
    """vLLM-named series in the router's registry; `observe_*` as requests run, `from_worker_stats`
    when the snapshot is taken."""

    def __init__(
        self, registry: CollectorRegistry, model_name: str, max_model_len: int, backend: str | None = None
    ) -> None:
        """`backend`: the manifest's KV backend, whose failure counter starts at 0."""
        r, L, self.model = registry, ["model_name"], model_name  # noqa: N806
        tokens = buckets_1_2_5(max(max_model_len, 1))

        def hist(name: str, doc: str, buckets: tuple) -> Histogram:
            return Histogram(f"vllm:{name}", doc, L, buckets=buckets, registry=r)

        self.ttft = hist(
            "time_to_first_token_seconds", "Histogram of time to first token in seconds.", TTFT_BUCKETS
        )
        self.itl = hist(
            "inter_token_latency_seconds", "Histogram of inter-token latency in seconds.", ITL_BUCKETS
        )
        self.request_tpot = hist(
            "request_time_per_output_token_seconds",
            "Histogram of time_per_output_token_seconds per request.",
            ITL_BUCKETS,
        )
        self.e2e = hist(
            "e2e_request_latency_seconds", "Histogram of e2e request latency in seconds.", REQUEST_BUCKETS
        )
        self.queue = hist(
            "request_queue_time_seconds",
            "Histogram of time spent in WAITING phase for request.",
            REQUEST_BUCKETS,
        )
        self.inference = hist(
            "request_inference_time_seconds",
            "Histogram of time spent in RUNNING phase for request.",
            REQUEST_BUCKETS,
        )
        self.prefill = hist(
            "request_prefill_time_seconds",
            "Histogram of time spent in PREFILL phase for request.",
            REQUEST_BUCKETS,
        )
        self.decode = hist(
            "request_decode_time_seconds",
            "Histogram of time spent in DECODE phase for request.",
            REQUEST_BUCKETS,
        )
        self.prompt_len = hist("request_prompt_tokens", "Number of prefill tokens processed.", tokens)
        self.output_len = hist("request_generation_tokens", "Number of generation tokens processed.", tokens)
        self.max_output_len = hist(
            "request_max_num_generation_tokens",
            "Histogram of maximum number of requested generation tokens.",
            tokens,
        )
        self.params_n = hist("request_params_n", "Histogram of the n request parameter.", N_BUCKETS)
        self.params_max_tokens = hist(
            "request_params_max_tokens", "Histogram of the max_tokens request parameter.", tokens
        )
        self.success = Counter(
            "vllm:request_success",
            "Count of successfully processed requests.",
            [*L, "finished_reason"],
            registry=r,
        )
        self.prompt_tokens = Counter(
            "vllm:prompt_tokens", "Number of prefill tokens processed.", L, registry=r
        )
        self.generation_tokens = Counter(
            "vllm:generation_tokens", "Number of generation tokens processed.", L, registry=r
        )
        self.kv_seconds = Histogram(
            "vllm:nixl_xfer_time_seconds",
            "Histogram of transfer duration for NIXL KV Cache transfers (here: every backend's).",
            [*L, "backend"], buckets=KV_SECONDS_BUCKETS, registry=r,
        )  # fmt: skip
        self.kv_bytes = Histogram(
            "vllm:nixl_bytes_transferred",
            "Histogram of bytes transferred per NIXL KV Cache transfers (here: every backend's).",
            [*L, "backend"], buckets=KV_BYTES_BUCKETS, registry=r,
        )  # fmt: skip
        self.kv_failed = Counter(
            "vllm:nixl_num_failed_transfers",
            "Number of failed NIXL KV Cache transfers (here: every backend's).",
            [*L, "backend"], registry=r,
        )  # fmt: skip
        self.workers = VllmWorkerMetrics(r, model_name)  # the scheduler's series, per worker
        r.register(_Derived(self))
        for reason in FINISHED_REASONS:  # at 0 from the start, so increase() sees the first one
            self.success.labels(model_name, reason)
        for c in (self.prompt_tokens, self.generation_tokens):
            c.labels(model_name)
        if backend is not None:
            self.kv_failed.labels(model_name, backend)
        self.itl_bound = self.itl.labels(model_name)  # one lookup, not one per token

    def observe_first(self, ttft: float, m: dict) -> None:
        """A choice's first token: TTFT, and the KV transfer that preceded it (m: the workers' metrics)."""
        self.ttft.labels(self.model).observe(ttft)
        self.observe_transfer(m)

    def observe_transfer(self, m: dict) -> None:
        """A KV transfer as the decode worker's first line reports it (`RouterMetrics.observe_transfer`)."""
        backend = m.get("kv_backend")
        if m.get("kv_fetch_s") is None or not backend:
            return
        if m.get("kv_error"):  # the transfer failed and the decode worker recomputed the prompt
            self.kv_failed.labels(self.model, backend).inc()
            return
        self.kv_seconds.labels(self.model, backend).observe(m["kv_fetch_s"])
        self.kv_bytes.labels(self.model, backend).observe(m.get("kv_bytes") or 0)

    def observe_done(self, run: RunFigures) -> None:
        """A request finished: its phases, token counts and parameters."""
        lab = self.model
        self.e2e.labels(lab).observe(run.e2e)
        self.prompt_tokens.labels(lab).inc(run.prompt_tokens)
        self.prompt_len.labels(lab).observe(run.prompt_tokens)
        self.output_len.labels(lab).observe(run.output_tokens)
        self.max_output_len.labels(lab).observe(run.max_choice_tokens)
        self.params_n.labels(lab).observe(run.n)
        self.params_max_tokens.labels(lab).observe(run.max_tokens)
        if run.queue_s is not None:
            self.queue.labels(lab).observe(run.queue_s)
        if run.ttft is None:
            return
        decode = max(0.0, run.e2e - run.ttft)
        self.decode.labels(lab).observe(decode)
        prefill = run.prefill_s if run.prefill_s is not None else max(0.0, run.ttft - (run.queue_s or 0.0))
        self.prefill.labels(lab).observe(prefill)
        self.inference.labels(lab).observe(prefill + decode)
        if run.max_choice_tokens > 1:
            self.request_tpot.labels(lab).observe(decode / (run.max_choice_tokens - 1))

    def from_worker_stats(self, rows: list[WorkerRow], router_waiting: int) -> None:
        """Every worker's scheduler figures, and the router's own queue as one more waiting series."""
        self.workers.waiting.labels(self.model, "router", "router").set(router_waiting)
        self.workers.update(rows)


@dataclass(slots=True)
class RunFigures:
    """What a finished request tells the vLLM histograms (router/run.py fills it)."""

    e2e: float
    ttft: float | None
    queue_s: float | None  # on the (prefill) worker, before its prefill started
    prefill_s: float | None
    prompt_tokens: int
    output_tokens: int  # every choice's
    max_choice_tokens: int  # the longest choice's
    n: int
    max_tokens: int  # as asked, or what the context leaves when not asked


class _Derived:
    """Series rendered from others: the older TPOT name as a copy of the ITL histogram, and the
    per-worker step histograms."""

    def __init__(self, v: VllmMetrics) -> None:
        self.v = v

    def collect(self) -> Iterator[Metric]:
        for fam in self.v.itl.collect():
            old, new = "vllm:inter_token_latency_seconds", "vllm:time_per_output_token_seconds"
            copy = Metric(
                new, "Histogram of time per output token in seconds (the inter-token latency).", "histogram"
            )
            copy.samples = [s._replace(name=s.name.replace(old, new)) for s in fam.samples]
            yield copy
        yield from self.v.workers.step_families()


__all__ = ["RunFigures", "VllmMetrics", "buckets_1_2_5"]
