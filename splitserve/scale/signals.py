"""What the controller reads each interval, from the router's own figures (no Prometheus server needed):

- TTFT and ITL: the router's histograms (`splitserve:time_to_first_token_seconds`,
  `splitserve:inter_token_latency_seconds`, the ones /metrics exports); the window's percentile comes
  from the difference of their bucket counts over the last `window_s`, interpolated within a bucket, as
  PromQL's `histogram_quantile(q, rate(...[window]))` does;
- prompt and generated tokens over the window (the load the planner's simulator replays);
- per role, from every worker's /stats: requests waiting and running in its engine, KV blocks in use.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass

from prometheus_client import Counter, Histogram

from splitserve.scale.decide import Sample, Shape
from splitserve.wire.stats import WorkerRow

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


def role_figures(rows: Sequence[WorkerRow]) -> tuple[dict[str, int], dict[str, int], dict[str, float]]:
    """Workers' rows -> per role: requests waiting, requests running, the fullest KV (0..1, blocks held
    for a late copy counted free). A worker down or without an answer this time adds nothing."""
    waiting: dict[str, int] = {}
    running: dict[str, int] = {}
    kv: dict[str, float] = {}
    for row in rows:
        s = row.stats
        if not row.up or s is None:
            continue
        waiting[row.role] = waiting.get(row.role, 0) + s.waiting
        running[row.role] = running.get(row.role, 0) + s.running
        if s.blocks.total:
            used = 1.0 - (s.blocks.free + s.blocks.held) / s.blocks.total
            kv[row.role] = max(kv.get(row.role, 0.0), used)
    return waiting, running, kv


@dataclass(frozen=True)
class _Snapshot:
    at: float
    ttft: Buckets
    itl: Buckets
    prompt_tokens: float
    output_tokens: float


class RouterSignals:
    """Reads one `Sample` per call from the router's metrics (`metrics`: router.metrics.RouterMetrics)
    and its workers' stats; `shape()` -> (serving replicas per role, replicas not yet settled). Figures
    are over the last `window_s` (one interval or more, as a PromQL rate window spans several scrapes);
    a percentile is judged only over at least `min_requests` observations per `window_s`."""

    def __init__(
        self,
        metrics: object,
        model: str,
        percentile: float,
        min_requests: int,
        window_s: float,
        worker_stats: Callable[[], Awaitable[list[WorkerRow]]],
        shape: Callable[[], tuple[Shape, int]],
        start: float | None = None,  # time.monotonic() of the first snapshot (default: now)
    ) -> None:
        self.m, self.model, self.q, self.min_requests = metrics, model, percentile, min_requests
        self.window_s = window_s
        self.worker_stats, self.shape = worker_stats, shape
        self._snaps: deque[_Snapshot] = deque([self._snapshot(time.monotonic() if start is None else start)])

    def _snapshot(self, now: float) -> _Snapshot:
        m, name = self.m, self.model
        return _Snapshot(now, buckets(m.ttft, name), buckets(m.itl, name),  # type: ignore[attr-defined]
                         _total(m.prompt_tokens, name), _total(m.generation_tokens, name))  # type: ignore[attr-defined]  # fmt: skip

    def read(self, now: float) -> tuple[tuple[float | None, int], tuple[float | None, int], int, int, float]:
        """-> ((TTFT q, count), (ITL q, count), prompt tokens, output tokens, seconds) over the window:
        since the newest snapshot at least `window_s` old (else the oldest kept)."""
        snap = self._snapshot(now)
        while len(self._snaps) > 1 and self._snaps[1].at <= now - self.window_s:
            self._snaps.popleft()
        base = self._snaps[0]
        self._snaps.append(snap)
        return (
            quantile(self.q, snap.ttft, base.ttft),
            quantile(self.q, snap.itl, base.itl),
            int(snap.prompt_tokens - base.prompt_tokens),
            int(snap.output_tokens - base.output_tokens),
            now - base.at,
        )

    async def sample(self, now: float) -> Sample:
        (ttft, n), (itl, n_itl), prompt, output, span = self.read(now)
        waiting, running, kv = role_figures(await self.worker_stats())
        replicas, pending = self.shape()
        # `min_requests` per `window_s`: a window that ran long (a slow /stats) asks as many more
        need = self.min_requests * max(1.0, span / self.window_s)
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
