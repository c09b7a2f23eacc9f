"""What the controller reads each interval, from the router's own figures (no Prometheus server needed):

- TTFT and ITL: the router's histograms (`splitserve:time_to_first_token_seconds`,
  `splitserve:inter_token_latency_seconds`, the ones /metrics exports); the interval's percentile comes
  from the difference of their bucket counts since the last read, interpolated within a bucket, as
  PromQL's `histogram_quantile(q, rate(...[interval]))` does;
- prompt and generated tokens over the interval (the load the planner's simulator replays);
- per role, from every worker's /stats: requests waiting and running in its engine, KV blocks in use.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from prometheus_client import Counter, Histogram

from splitserve.scale.decide import Sample, Shape

Buckets = list[tuple[float, float]]  # (upper bound, cumulative count)


def buckets(hist: Histogram, model: str) -> Buckets:
    """A histogram's cumulative bucket counts for one model name."""
    out = []
    for metric in hist.collect():
        for s in metric.samples:
            if s.name.endswith("_bucket") and s.labels.get("model_name") == model:
                out.append((float(s.labels["le"]), s.value))
    return sorted(out)


def quantile(q: float, now: Buckets, before: Buckets) -> tuple[float | None, int]:
    """The q-quantile of what was observed between two reads of a histogram, and how many that was."""
    prev = dict(before)
    delta = [(le, c - prev.get(le, 0.0)) for le, c in now]
    total = delta[-1][1] if delta else 0.0
    if total <= 0:
        return None, 0
    rank, lower, below = q * total, 0.0, 0.0
    for le, c in delta:
        if c >= rank:
            if le == float("inf"):
                return lower, int(total)  # past the largest bound: the bound, as PromQL answers
            share = (rank - below) / (c - below) if c > below else 1.0
            return lower + (le - lower) * share, int(total)
        lower, below = le, c
    return lower, int(total)


def _total(counter: Counter, model: str) -> float:
    for metric in counter.collect():
        for s in metric.samples:
            if s.name.endswith("_total") and s.labels.get("model_name") == model:
                return s.value
    return 0.0


def role_figures(rows: Sequence[dict]) -> tuple[dict[str, int], dict[str, int], dict[str, float]]:
    """Worker /stats rows -> per role: requests waiting, requests running, the fullest KV (0..1)."""
    waiting: dict[str, int] = {}
    running: dict[str, int] = {}
    kv: dict[str, float] = {}
    for row in rows:
        role = row.get("role", "")
        if not row.get("up", True) or "running" not in row:
            continue
        waiting[role] = waiting.get(role, 0) + int(row.get("waiting", 0))
        running[role] = running.get(role, 0) + int(row.get("running", 0))
        blocks = row.get("blocks") or {}
        if blocks.get("total"):
            used = 1.0 - (blocks["free"] + blocks.get("held", 0)) / blocks["total"]
            kv[role] = max(kv.get(role, 0.0), used)
    return waiting, running, kv


class RouterSignals:
    """Reads one `Sample` per call from the router's metrics (`metrics`: router.metrics.RouterMetrics)
    and its workers' stats; `shape()` -> (serving replicas per role, replicas not yet settled). A
    percentile is judged only over at least `min_requests` observations per `interval_s`."""

    def __init__(
        self,
        metrics: object,
        model: str,
        percentile: float,
        min_requests: int,
        interval_s: float,
        worker_stats: Callable[[], Awaitable[list[dict]]],
        shape: Callable[[], tuple[Shape, int]],
    ) -> None:
        self.m, self.model, self.q, self.min_requests = metrics, model, percentile, min_requests
        self.interval_s = interval_s
        self.worker_stats, self.shape = worker_stats, shape
        self._last: dict[str, Buckets] = {}
        self._tokens: tuple[float, float] = (0.0, 0.0)
        self._at: float | None = None
        self.read(0.0)  # from here on

    def read(self, now: float) -> tuple[tuple[float | None, int], tuple[float | None, int], int, int, float]:
        """-> ((TTFT q, count), (ITL q, count), prompt tokens, output tokens, seconds) since the last read."""
        m = self.m
        ttft_b, itl_b = buckets(m.ttft, self.model), buckets(m.itl, self.model)  # type: ignore[attr-defined]
        ttft = quantile(self.q, ttft_b, self._last.get("ttft", []))
        itl = quantile(self.q, itl_b, self._last.get("itl", []))
        self._last = {"ttft": ttft_b, "itl": itl_b}
        tokens = (_total(m.prompt_tokens, self.model), _total(m.generation_tokens, self.model))  # type: ignore[attr-defined]
        prompt, output = int(tokens[0] - self._tokens[0]), int(tokens[1] - self._tokens[1])
        self._tokens = tokens
        span = 0.0 if self._at is None else now - self._at
        self._at = now
        return ttft, itl, prompt, output, span

    async def sample(self, now: float) -> Sample:
        (ttft, n), (itl, n_itl), prompt, output, span = self.read(now)
        waiting, running, kv = role_figures(await self.worker_stats())
        replicas, pending = self.shape()
        # `min_requests` per `interval_s`: an interval that ran long (a slow /stats) asks as many more
        need = self.min_requests * max(1.0, span / self.interval_s)
        return Sample(
            now=now,
            ttft_s=ttft if n >= need else None,
            itl_s=itl if n_itl >= need else None,
            requests=n,
            replicas=replicas,
            waiting=waiting,
            running=running,
            kv_usage=kv,
            pending=pending,
            interval_s=span,
            prompt_tokens=prompt,
            output_tokens=output,
        )


__all__ = ["RouterSignals", "buckets", "quantile", "role_figures"]
