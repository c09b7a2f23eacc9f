"""The report of a benchmark, in its output folder: report.json (everything), report.html (tables, the
verdict with its rules and evidence, the plots), PNG plots (matplotlib, the `bench` extra; without it the
HTML says so) and a short text summary for the terminal.
"""

from __future__ import annotations

import html
import json
import math
from pathlib import Path
from typing import Any

from splitserve.ab import plots
from splitserve.ab.plots import rate_label

DEFINITIONS = [
    ("TTFT", "first streamed chunk with a choice minus the request's send time (client side)"),
    ("ITL", "gap between two successive chunks with a choice, pooled over requests"),
    ("TPOT", "(e2e - TTFT) / (output tokens - 1), requests of more than one token"),
    ("e2e", "last chunk with a choice minus send time"),
    ("output tokens", "usage.completion_tokens of the stream's final chunk"),
    ("throughput", "completed requests (or tokens) / run duration (first send to last answer)"),
    ("goodput", "requests meeting every SLO (TPOT of one-token answers counts as 0) / run duration"),
    ("SLO attainment", "requests meeting every SLO / requests sent (failures miss)"),
    ("DistServe goodput", "highest swept rate whose attainment, and every lower rate's, is >= target"),
    ("cost per accepted response", "USD/hour of the deployment x run duration (h) / requests meeting SLOs"),
    ("USD/hour", "sum over workers of prices.usd_per_hour[device kind]: one device per worker replica"),
    ("KV share of TTFT", "sum of KV fetch seconds / sum of TTFT seconds, from the server's /metrics"),
]


def clean(x: Any) -> Any:
    """JSON-safe: NaN -> None, inf -> "inf"."""
    if isinstance(x, float):
        return None if math.isnan(x) else ("inf" if x == math.inf else "-inf" if x == -math.inf else x)
    if isinstance(x, dict):
        return {str(k): clean(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [clean(v) for v in x]
    return x


def write_json(out: Path, report: dict) -> Path:
    path = out / "report.json"
    path.write_text(json.dumps(clean(report), indent=1))
    return path


def _f(x: Any, digits: int = 1) -> str:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    return f"{x:.{digits}f}" if isinstance(x, float) else str(x)


def summary_rows(report: dict) -> list[dict[str, str]]:
    """One row per target and rate: the figures of the summary table."""
    rows = []
    for t in report["targets"]:
        for p in t["points"]:
            m, s = p["metrics"], p.get("server") or {}
            cost = p["cost_per_accepted_usd"]
            rows.append(
                {
                    "target": t["name"],
                    "rate": rate_label(p["rate"]),
                    "ok/sent": f"{m['completed']}/{m['requests']}",
                    "TTFT p50": _f(m["ttft_ms"]["p50"], 0),
                    "TTFT p99": _f(m["ttft_ms"]["p99"], 0),
                    "TPOT p50": _f(m["tpot_ms"]["p50"]),
                    "TPOT p99": _f(m["tpot_ms"]["p99"]),
                    "out tok/s": _f(m["output_throughput"]),
                    "req/s": _f(m["request_throughput"], 2),
                    "goodput": _f(m["goodput_rps"], 2),
                    "SLO att.": f"{m['slo_attainment']:.0%}" if m["requests"] else "-",
                    "$/1k acc.": "inf" if math.isinf(cost) else f"{cost * 1e3:.4f}",
                    "KV % TTFT": _pct(s.get("kv_share_of_ttft")),
                    "CPU cores": _f(p["util"].get("cpu_deployment_cores"), 2),
                }
            )
    return rows


def _pct(x: float | None) -> str:
    return "-" if x is None or math.isnan(x) else f"{x:.1%}"


def text_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return "(no results)"
    cols = list(rows[0])
    width = {c: max(len(c), *(len(r[c]) for r in rows)) for c in cols}
    lines = ["  ".join(c.rjust(width[c]) if i else c.ljust(width[c]) for i, c in enumerate(cols))]
    for r in rows:
        lines.append(
            "  ".join(r[c].rjust(width[c]) if i else r[c].ljust(width[c]) for i, c in enumerate(cols))
        )
    return "\n".join(lines)


def markdown_table(rows: list[dict[str, str]]) -> str:
    if not rows:
        return ""
    cols = list(rows[0])
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    out += ["| " + " | ".join(r[c] for c in cols) + " |" for r in rows]
    return "\n".join(out)


def text_summary(report: dict) -> str:
    lines = [f"workload: {report['workload']['description']}", f"SLOs: {report['slo']}", ""]
    lines.append(text_table(summary_rows(report)))
    lines.append("")
    for t in report["targets"]:
        hw = t["hardware"].get("formula", "?")
        lines.append(
            f"{t['name']}: {t.get('mode') or '?'}, {hw}" + (f"  FAILED: {t['error']}" if t["error"] else "")
        )
    for v in report["verdicts"]:
        lines.append(
            f"verdict {v['candidate']} vs {v['baseline']}: {v['verdict'].upper()} ({v['rule']}): "
            + "; ".join(v["reasons"])
        )
    lines.append(f"gate (splitserve verify): {report['gate']['status']}")
    return "\n".join(lines)


# ---- plots ------------------------------------------------------------------------------------------


def write_plots(out: Path, report: dict) -> list[str]:
    """PNG plots into `out`; their file names (none without matplotlib)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return []
    made = []
    for name, fn in plots.PLOTS:
        fig = fn(plt, report)
        if fig is None:
            continue
        fig.savefig(out / name, dpi=110, bbox_inches="tight")
        plt.close(fig)
        made.append(name)
    return made


# ---- HTML -------------------------------------------------------------------------------------------

_CSS = """body{font-family:system-ui,sans-serif;max-width:1200px;margin:2em auto;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}
td,th{border:1px solid #ccc;padding:3px 8px;text-align:right}
th{background:#f3f3f3}td:first-child,th:first-child{text-align:left}
.trial{color:#fff;background:#2a7d2a}.wait{color:#222;background:#f0c040}.reject{color:#fff;background:#b03030}
.badge{padding:2px 10px;border-radius:4px;font-weight:bold}
img{max-width:100%;border:1px solid #ddd;margin:.5em 0}
code,pre{background:#f6f6f6}"""


def _table(rows: list[dict[str, Any]]) -> str:
    if not rows:
        return "<p>(none)</p>"
    cols = list(rows[0])
    head = "".join(f"<th>{html.escape(str(c))}</th>" for c in cols)
    body = "".join(
        "<tr>" + "".join(f"<td>{html.escape(str(r.get(c, '')))}</td>" for c in cols) + "</tr>" for r in rows
    )
    return f"<table><tr>{head}</tr>{body}</table>"


def _breakdown_rows(report: dict) -> list[dict]:
    rows = []
    for t in report["targets"]:
        for p in t["points"]:
            s = p.get("server") or {}
            if not s:
                continue
            kv = s.get("kv") or {}
            rows.append(
                {
                    "target": t["name"],
                    "rate": rate_label(p["rate"]),
                    "server TTFT ms": _f(s.get("ttft_ms")),
                    "queue ms": _f(s.get("queue_ms")),
                    "prefill ms": _f(s.get("prefill_ms")),
                    "transfer incl. wait ms": _f(s.get("transfer_incl_wait_ms")),
                    "first decode ms": _f(s.get("first_decode_ms")),
                    "KV fetch ms (backend)": ", ".join(f"{b['mean_ms']:.1f} ({k})" for k, b in kv.items())
                    or "-",
                    "KV MiB/req": ", ".join(f"{b['mean_mib']:.2f}" for b in kv.values()) or "-",
                    "KV % TTFT": _pct(s.get("kv_share_of_ttft")),
                    "errors": ", ".join(f"{k}: {v}" for k, v in (s.get("errors_by_status") or {}).items())
                    or "-",
                    "host CPU %": _f(p["util"].get("cpu_host_pct")),
                    "other procs cores": _f(p["util"].get("cpu_other_cores"), 2),
                    "GPU %": _f(p["util"].get("gpu_util_pct")),
                }
            )
    return rows


def _latency_rows(report: dict) -> list[dict]:
    rows = []
    for t in report["targets"]:
        for p in t["points"]:
            m = p["metrics"]
            for key, label in (
                ("ttft_ms", "TTFT"),
                ("tpot_ms", "TPOT"),
                ("itl_ms", "ITL"),
                ("e2el_ms", "e2e"),
            ):
                st = m[key]
                rows.append(
                    {"target": t["name"], "rate": rate_label(p["rate"]), "metric": label}
                    | {k: _f(st[k]) for k in ("mean", "p50", "p90", "p95", "p99")}
                )
            if m["failures"]:
                rows[-1]["failures"] = ", ".join(f"{k}: {v}" for k, v in m["failures"].items())
    for r in rows:
        r.setdefault("failures", "")
    return rows


def _verdict_html(v: dict) -> str:
    rows = [
        {
            "rate": rate_label(r["rate"]),
            "baseline goodput": _f(r["baseline_goodput_rps"], 3),
            "candidate goodput": _f(r["candidate_goodput_rps"], 3),
            "baseline att.": _pct(r["baseline_attainment"]),
            "candidate att.": _pct(r["candidate_attainment"]),
            "ratio per $": _f(r["ratio_per_usd"], 2),
            "90% interval": f"{_f(r['ci90'][0], 2)} - {_f(r['ci90'][1], 2)}",
            "class": r["class"],
            "candidate KV % TTFT": _pct(r["candidate_kv_share"]),
            "other procs cores (cand / base)": " / ".join(_f(x, 2) for x in r.get("other_cpu_cores", [])),
        }
        for r in v["rows"]
    ]
    ds = ", ".join(f"{k}: {'-' if x is None else f'{x:g} req/s'}" for k, x in v["distserve"].items())
    reasons = "".join(f"<li>{html.escape(x)}</li>" for x in v["reasons"])
    return (
        f"<h3>{html.escape(v['candidate'])} vs {html.escape(v['baseline'])}: "
        f"<span class='badge {v['verdict']}'>{v['verdict'].upper()}</span> (rule {v['rule']})</h3>"
        f"<ul>{reasons}</ul><p>DistServe goodput (attainment target): {html.escape(ds)}</p>{_table(rows)}"
    )


def write_html(out: Path, report: dict, plots: list[str]) -> Path:
    cfg = report["config"]
    parts = [f"<!doctype html><meta charset='utf-8'><title>splitserve bench</title><style>{_CSS}</style>"]
    parts.append("<h1>splitserve bench</h1>")
    parts.append(
        f"<p>{html.escape(report['created'])} &middot; code {html.escape(report.get('code', '?'))} &middot; "
        f"<code>{html.escape(report['command'])}</code></p>"
    )
    parts.append(
        f"<p>Workload: {html.escape(report['workload']['description'])}<br>SLOs: "
        f"{html.escape(report['slo'])} (attainment target {cfg['attainment_target']:.0%})<br>"
        f"Gate (<code>splitserve verify</code>): <b>{html.escape(report['gate']['status'])}</b> - "
        f"{html.escape(report['gate']['detail'])}</p>"
    )
    hw = [
        {
            "target": t["name"],
            "source": t["source"],
            "mode": t.get("mode") or "?",
            "model": t.get("model", ""),
            "hardware and price": t["hardware"].get("formula", "?"),
            "status": t["error"] or "ok",
        }
        for t in report["targets"]
    ]
    parts += ["<h2>Targets</h2>", _table(hw), "<h2>Verdict</h2>"]
    parts += [_verdict_html(v) for v in report["verdicts"]] or ["<p>(one target: no comparison)</p>"]
    parts.append(
        "<p>Rules:</p><ol>" + "".join(f"<li>{html.escape(r)}</li>" for r in report["rules"]) + "</ol>"
    )
    parts += ["<h2>Summary</h2>", _table(summary_rows(report))]
    parts += ["<h2>Plots</h2>"] + [f"<p><img src='{p}' alt='{p}'></p>" for p in plots]
    if not plots:
        parts.append(
            "<p>No plots: matplotlib is not installed (<code>pip install 'splitserve[bench]'</code>).</p>"
        )
    parts += ["<h2>Latency (ms)</h2>", _table(_latency_rows(report))]
    parts += ["<h2>Server side: TTFT parts, KV transfer, utilization</h2>", _table(_breakdown_rows(report))]
    parts += ["<h2>Definitions</h2>", _table([{"metric": k, "definition": v} for k, v in DEFINITIONS])]
    parts.append(f"<p>Per-request records: <code>requests/</code>. Seed {cfg['seed']}.</p>")
    path = out / "report.html"
    path.write_text("\n".join(parts))
    return path


__all__ = [
    "clean",
    "markdown_table",
    "summary_rows",
    "text_summary",
    "write_html",
    "write_json",
    "write_plots",
]
