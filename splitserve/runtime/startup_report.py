"""Where a start's time went, per process: the end of the line `splitserve serve` prints when it is ready,
and the same figures in its ready event (`"startup"`).

    splitserve: serving ... at ...; ready in 1.7 s; router: imports 0.7, tokenizer 0.1, workers 0.8,
      warm-up 0.1 | colocated-0 0.7: front end imports 0.2, tokenizer 0.1, http 0.2; core imports 0.0,
      weights 0.1, engine 0.2

Each process notes its age at the end of each phase (startup_clock.py); a phase's seconds are the
difference from the previous mark. Router: `imports` (interpreter start-up and imports), `tokenizer`
(then it serves 503s), `workers` (spawn to every worker ready), `warm-up`. A worker (its figure:
spawn to ready, as the router saw it): its front end's `imports` (up to handing the core its spec),
`tokenizer` and `http` (the HTTP stack's imports and the collector's pass, while the core loads); its
engine core's `imports` (torch, the engine: none for a core forked from the fork server), `weights`
(the load, from its load stats) and `engine` (the rest: the KV cache, CPU ops, the warm-up forward).
A worker adopted from the warm spare shows `(spare)`: its imports were done before it was asked for.
"""

from __future__ import annotations

from typing import Any


def phases(marks: dict[str, float]) -> dict[str, float]:
    """{phase: seconds} from {phase: the process's age when it ended}, in order."""
    out, before = {}, 0.0
    for name, age in marks.items():
        out[name] = round(max(0.0, age - before), 3)
        before = age
    return out


def worker_phases(w: dict[str, Any]) -> dict[str, Any]:
    info = w.get("info") or {}
    front = phases(info.get("front_end") or {})
    core = phases(info.get("startup") or {})
    weights = float((info.get("load") or {}).get("total_seconds") or 0.0)
    out: dict[str, Any] = {"ready_s": w.get("startup_s"), "from_standby": bool(info.get("from_standby"))}
    out["front_end"] = {k: v for k, v in front.items() if k in ("imports", "tokenizer", "http")}
    if core:
        engine = core.get("engine", 0.0)
        out["core"] = {"imports": core.get("imports", 0.0), "weights": round(min(weights, engine), 3),
                       "engine": round(max(0.0, engine - weights), 3)}  # fmt: skip
    return out


def report(total_s: float, router: dict[str, float], workers: list[dict[str, Any]]) -> dict[str, Any]:
    return {"ready_s": round(total_s, 3), "router": router,
            "workers": {w["name"]: worker_phases(w) for w in workers}}  # fmt: skip


def line(rep: dict[str, Any]) -> str:
    """The ready line's breakdown (see the module docstring)."""

    def fmt(d: dict[str, float]) -> str:
        return ", ".join(f"{k.replace('_', '-')} {v:.2f}" for k, v in d.items())

    parts = [f"router: {fmt(rep['router'])}"]
    for name, w in rep["workers"].items():
        spare = " (spare)" if w["from_standby"] else ""
        head = f"{name} {w['ready_s']:.2f}{spare}" if w["ready_s"] is not None else name
        body = f"front end {fmt(w['front_end'])}" + (f"; core {fmt(w['core'])}" if "core" in w else "")
        parts.append(f"{head}: {body}")
    return f"ready in {rep['ready_s']:.2f} s; " + " | ".join(parts)


__all__ = ["line", "phases", "report", "worker_phases"]
