"""The benchmark's math, as `vllm bench serve` defines it (pure functions over the client's records).

Per successful request (n = usage.completion_tokens):
    TTFT      first chunk with a choice - send
    e2e       last chunk with a choice - send
    TPOT      (e2e - TTFT) / (n - 1), for n > 1 (a request of one token has no TPOT; for the SLO check
              it counts as 0, as vLLM does)
    ITL       every gap between two chunks with a choice, pooled over requests
Per run (duration = first send to last answer):
    request throughput = completed / duration; output throughput = sum n / duration;
    total token throughput = (sum prompt tokens + sum n) / duration
    goodput   = requests that met every SLO (TTFT <= slo, TPOT <= slo, e2e <= slo if set) / duration
                (DistServe's SLO-attaining requests per second; vLLM's `request_goodput`)
    SLO attainment = those requests / all requests sent (a failed request misses its SLOs)
Across a rate sweep, DistServe's goodput: the highest request rate whose attainment (and that of every
lower rate) reaches the target (90%). Percentiles: numpy's linear interpolation (np.percentile).
Cost per accepted response = instance USD/hour x wall time (h) / requests that met the SLOs.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from splitserve.ab.client import RequestResult

PERCENTILES = (50, 90, 95, 99)


@dataclass(frozen=True)
class SLO:
    ttft_ms: float | None = 2000.0
    tpot_ms: float | None = 200.0
    e2e_ms: float | None = None

    def describe(self) -> str:
        parts = [f"{k} <= {v:g} ms" for k, v in (("TTFT", self.ttft_ms), ("TPOT", self.tpot_ms)) if v]
        if self.e2e_ms:
            parts.append(f"e2e <= {self.e2e_ms:g} ms")
        return ", ".join(parts) or "none"


def percentile(values: Sequence[float], p: float) -> float:
    """np.percentile (linear interpolation); NaN for no values."""
    return float(np.percentile(np.asarray(values, dtype=float), p)) if len(values) else math.nan


def stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    """mean, std, p50 (median), p90, p95, p99 and max of seconds, in milliseconds."""
    if not len(values_s):
        return {"count": 0, "mean": math.nan, "std": math.nan, "max": math.nan} | {
            f"p{p}": math.nan for p in PERCENTILES
        }
    x = np.asarray(values_s, dtype=float) * 1e3
    out = {"count": int(x.size), "mean": float(x.mean()), "std": float(x.std()), "max": float(x.max())}
    return out | {f"p{p}": float(np.percentile(x, p)) for p in PERCENTILES}


def output_tokens(r: RequestResult) -> int:
    """usage.completion_tokens; without usage, the chunks received (each at least one token)."""
    return r.output_tokens or (len(r.itl_s) + 1 if r.success else 0)


def tpot_s(latency_s: float, ttft_s: float, n_tokens: int) -> float | None:
    """Time per output token after the first; None for n_tokens <= 1."""
    return (latency_s - ttft_s) / (n_tokens - 1) if n_tokens > 1 else None


def meets_slo(r: RequestResult, slo: SLO) -> bool:
    if not r.success:
        return False
    tpot = tpot_s(r.latency_s, r.ttft_s, output_tokens(r)) or 0.0
    checks = ((slo.ttft_ms, r.ttft_s), (slo.tpot_ms, tpot), (slo.e2e_ms, r.latency_s))
    return all(limit is None or value * 1e3 <= limit for limit, value in checks)


def summarize(results: Sequence[RequestResult], duration_s: float, slo: SLO) -> dict:
    """One run's metrics (see the module docstring)."""
    ok = [r for r in results if r.success]
    n_out = [output_tokens(r) for r in ok]
    tpots = [t for r, n in zip(ok, n_out, strict=True) if (t := tpot_s(r.latency_s, r.ttft_s, n)) is not None]
    good = sum(meets_slo(r, slo) for r in results)
    dur = max(duration_s, 1e-9)
    total_in = sum(r.prompt_len for r in ok)
    return {
        "requests": len(results),
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "failures": dict(Counter(r.error_kind for r in results if not r.success)),
        "duration_s": duration_s,
        "total_input_tokens": total_in,
        "total_output_tokens": sum(n_out),
        "request_throughput": len(ok) / dur,
        "output_throughput": sum(n_out) / dur,
        "total_token_throughput": (total_in + sum(n_out)) / dur,
        "ttft_ms": stats_ms([r.ttft_s for r in ok]),
        "tpot_ms": stats_ms(tpots),
        "itl_ms": stats_ms([g for r in ok for g in r.itl_s]),
        "e2el_ms": stats_ms([r.latency_s for r in ok]),
        "good": good,
        "goodput_rps": good / dur,
        "slo_attainment": good / len(results) if results else math.nan,
    }


def cost_per_accepted(usd_per_hour: float, wall_s: float, accepted: int) -> float:
    """USD per response that met the SLOs: usd_per_hour * wall_s / 3600 / accepted (inf if none)."""
    return usd_per_hour * wall_s / 3600.0 / accepted if accepted > 0 else math.inf


def distserve_goodput(points: Iterable[tuple[float, float]], target: float = 0.9) -> float | None:
    """The highest rate whose SLO attainment, and that of every lower rate, is >= target.
    points: (rate, attainment). None when even the lowest rate misses."""
    best = None
    for rate, attainment in sorted(points):
        if not attainment >= target:  # NaN misses too
            break
        best = rate
    return best


def bootstrap_ratio(
    good_a: int,
    n_a: int,
    scale_a: float,
    good_b: int,
    n_b: int,
    scale_b: float,
    iters: int = 4000,
    seed: int = 0,
) -> tuple[float, float, float]:
    """(a / b, lower, upper) of two goodputs, each `good * scale` (scale: 1 / duration, or 1 / (duration
    x price) for goodput per dollar), with a 90% bootstrap interval: resampling a run's n requests makes
    its good count Binomial(n, good / n). A goodput b of 0 gives NaN."""
    if n_a <= 0 or n_b <= 0 or good_b == 0:
        return math.nan, math.nan, math.nan
    rng = np.random.default_rng(seed)
    a = rng.binomial(n_a, good_a / n_a, iters) * scale_a
    b = rng.binomial(n_b, good_b / n_b, iters) * scale_b
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = np.where(b > 0, a / np.where(b > 0, b, 1), np.inf)
    lo, hi = np.percentile(ratio, [5, 95], method="inverted_cdf")  # no interpolation (ratios may be inf)
    return (good_a * scale_a) / (good_b * scale_b), float(lo), float(hi)


__all__ = [
    "PERCENTILES",
    "SLO",
    "bootstrap_ratio",
    "cost_per_accepted",
    "distserve_goodput",
    "meets_slo",
    "output_tokens",
    "percentile",
    "stats_ms",
    "summarize",
    "tpot_s",
]
