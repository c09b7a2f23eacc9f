"""The report's plots (matplotlib figures from a report dict). Rates sit at even spacing on the x axis,
labelled with their values (so inf and recorded traces fit)."""

from __future__ import annotations

import math
from typing import Any


def rate_label(rate: float | None) -> str:
    """A rate as the report labels it (its plots' x ticks and its tables' rate column)."""
    return "recorded" if rate is None else "inf" if math.isinf(rate) else f"{rate:g}"


_PARTS = (
    ("queue_ms", "queue (prefill worker)"),
    ("prefill_ms", "prefill"),
    ("transfer_incl_wait_ms", "KV transfer incl. wait"),
    ("first_decode_ms", "first decode + hops"),
)


def _rates(report: dict) -> list[str]:
    seen: list[str] = []
    for t in report["targets"]:
        for p in t["points"]:
            if (lab := rate_label(p["rate"])) not in seen:
                seen.append(lab)
    return seen


def _series(report: dict, t: dict, get: Any) -> tuple[list[int], list[float]]:
    labels = _rates(report)
    xs, ys = [], []
    for p in t["points"]:
        y = get(p)
        if y is not None and not (isinstance(y, float) and (math.isnan(y) or math.isinf(y))):
            xs.append(labels.index(rate_label(p["rate"])))
            ys.append(y)
    return xs, ys


def _axes_rates(ax: Any, report: dict) -> None:
    labels = _rates(report)
    ax.set_xticks(range(len(labels)), labels)
    ax.set_xlabel("offered request rate (req/s)")
    ax.grid(alpha=0.3)


def goodput(plt: Any, report: dict) -> Any:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    for t in report["targets"]:
        xs, ys = _series(report, t, lambda p: p["metrics"]["goodput_rps"])
        (line,) = a1.plot(xs, ys, "o-", label=f"{t['name']} goodput")
        xs, ys = _series(report, t, lambda p: p["metrics"]["request_throughput"])
        a1.plot(xs, ys, "x--", color=line.get_color(), alpha=0.6, label=f"{t['name']} throughput")
        xs, ys = _series(report, t, lambda p: 100 * p["metrics"]["slo_attainment"])
        a2.plot(xs, ys, "o-", color=line.get_color(), label=t["name"])
    _mark_busy(a2, report, lambda p: 100 * p["metrics"]["slo_attainment"])
    a1.set_ylabel("requests/s")
    a1.set_title("goodput (met SLOs) and throughput")
    a2.axhline(100 * report["config"]["attainment_target"], color="gray", ls=":", label="target")
    a2.set_ylabel("% of requests meeting SLOs")
    a2.set_ylim(0, 105)
    a2.set_title(f"SLO attainment ({report['slo']})")
    for a in (a1, a2):
        _axes_rates(a, report)
        a.legend(fontsize=8)
    fig.tight_layout()
    return fig


def _mark_busy(ax: Any, report: dict, get: Any) -> None:
    """Flag the points measured while other processes used more than the noise threshold of CPU."""
    limit = report["config"].get("max_interference_cores", 0.25)
    labels = _rates(report)
    for t in report["targets"]:
        for p in t["points"]:
            other = (p.get("util") or {}).get("cpu_other_cores")
            if isinstance(other, float) and other > limit:
                x = labels.index(rate_label(p["rate"]))
                ax.annotate(f"busy host\n(+{other:.1f} cores)", (x, get(p)), textcoords="offset points",
                            xytext=(6, -18), fontsize=7, color="gray")  # fmt: skip


def latency(plt: Any, report: dict) -> Any:
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    slo = report["config"]["slo"]
    for ax, key, name, limit in (
        (axes[0], "ttft_ms", "TTFT", slo["ttft_ms"]),
        (axes[1], "tpot_ms", "TPOT", slo["tpot_ms"]),
    ):
        for t in report["targets"]:
            xs, ys = _series(report, t, lambda p, k=key: p["metrics"][k]["p50"])
            (line,) = ax.plot(xs, ys, "o-", label=f"{t['name']} p50")
            xs, ys = _series(report, t, lambda p, k=key: p["metrics"][k]["p99"])
            ax.plot(xs, ys, "^--", color=line.get_color(), alpha=0.7, label=f"{t['name']} p99")
        if limit:
            ax.axhline(limit, color="red", ls=":", label=f"SLO {limit:g} ms")
        ax.set_ylabel(f"{name} (ms)")
        ax.set_yscale("log")
        ax.set_title(f"{name} p50 / p99")
        _axes_rates(ax, report)
        ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


def ttft_breakdown(plt: Any, report: dict) -> Any:
    bars = [(t["name"], rate_label(p["rate"]), p["server"]) for t in report["targets"] for p in t["points"]]
    bars = [b for b in bars if b[2] and not math.isnan(b[2].get("ttft_ms", math.nan))]
    if not bars:
        return None
    fig, ax = plt.subplots(figsize=(max(6, 0.9 * len(bars) + 2), 4))
    bottom = [0.0] * len(bars)
    for key, label in _PARTS:
        vals = [0.0 if math.isnan(b[2].get(key, math.nan)) else b[2][key] for b in bars]
        ax.bar(range(len(bars)), vals, bottom=bottom, label=label)
        bottom = [x + v for x, v in zip(bottom, vals, strict=True)]
    ax.set_xticks(range(len(bars)), [f"{n}\n@{r}" for n, r, _ in bars], fontsize=7, rotation=20, ha="right")
    ax.set_ylabel("mean ms per request (server side)")
    ax.set_title("where TTFT goes (router /metrics)")
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    return fig


def cost(plt: Any, report: dict) -> Any:
    fig, ax = plt.subplots(figsize=(6, 4))
    for t in report["targets"]:
        xs, ys = _series(report, t, lambda p: p["cost_per_accepted_usd"] * 1e3)
        ax.plot(xs, ys, "o-", label=f"{t['name']} ({t['hardware'].get('formula', '?').split(' = ')[-1]})")
    ax.set_ylabel("USD per 1,000 responses meeting SLOs")
    ax.set_title("cost per accepted response")
    _axes_rates(ax, report)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return fig


PLOTS = (
    ("goodput.png", goodput),
    ("latency.png", latency),
    ("ttft_breakdown.png", ttft_breakdown),
    ("cost.png", cost),
)

__all__ = ["PLOTS"]
