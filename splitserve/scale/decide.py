"""The controller's decision: one interval's figures in, at most one replica of one role added or removed.

A pure function of a `Sample` (what the router saw over the last interval), the `Policy` (the manifest's
SLOs, bounds and delays) and the controller's `Memory` (when it last changed the shape, since when the
deployment has been comfortably within its SLOs), as Dynamo's planner and Ray Serve's autoscaler decide:

  pressure   TTFT over its SLO, or prefill requests queueing          -> add a prefill replica
             ITL over its SLO, decode KV nearly full or decode queueing -> add a decode replica
             (both: the role whose figure is further over its SLO, or the one the planner's simulator
             says helps most); colocated: either -> add a colocated replica
  comfort    both figures under `low_load` x their SLO (a figure with too few observations: at most
             `low_load` requests per replica in the engines) for `down_after_s` in a row
             -> remove a replica of the role with most headroom above its minimum (one the
             simulator, when given, says the smaller shape still serves within the SLOs)
  otherwise  hold: inside the hysteresis band, in the cooldown after a change, or at a bound.
Every decision has a reason (`REASONS`), logged and counted by the controller.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

Shape = dict[str, int]  # role -> replicas
TARGET = 0.9  # the planner's bar: a shape holds the SLOs when 90% of requests meet both (as plan/search.py)
# reasons of a decision: what it was taken on (an add's, a removal's, a hold's)
REASONS = ("ttft_slo", "itl_slo", "prefill_queue", "decode_queue", "decode_kv", "queue", "low_load",
           "steady", "cooldown", "at_max", "at_min", "warming", "planner")  # fmt: skip


@dataclass(frozen=True)
class Sample:
    """One interval as the router saw it. `ttft_s` / `itl_s`: the policy's percentile over the
    interval (None: too few observations); per role: replicas serving, requests waiting in their
    engines, requests running, KV blocks in use (0..1, the fullest replica's)."""

    now: float
    ttft_s: float | None
    itl_s: float | None
    requests: int  # first tokens in the interval
    replicas: Shape
    waiting: Mapping[str, int] = field(default_factory=dict)
    running: Mapping[str, int] = field(default_factory=dict)
    kv_usage: Mapping[str, float] = field(default_factory=dict)
    pending: int = 0  # replicas added or being removed and not yet settled (starting, draining)
    interval_s: float = 0.0  # what the figures span; with the tokens, the load the planner replays
    prompt_tokens: int = 0
    output_tokens: int = 0


@dataclass(frozen=True)
class Policy:
    ttft_s: float
    itl_s: float
    bounds: Mapping[str, tuple[int, int]]  # role -> (min, max)
    cooldown_s: float = 30.0
    down_after_s: float = 60.0
    low_load: float = 0.5
    max_waiting_per_replica: float = 8.0
    max_kv_usage: float = 0.9


@dataclass
class Memory:
    last_change: float = -math.inf
    comfortable_since: float | None = None


@dataclass(frozen=True)
class Decision:
    role: str | None  # None: hold
    delta: int  # +1, -1 or 0
    reason: str
    detail: str = ""

    @property
    def action(self) -> str:
        return {1: "add", -1: "remove"}.get(self.delta, "hold")


# the planner's model, when given: would `shape` serve the load of `sample` within the SLOs?
# -> its predicted share of requests within both SLOs (0..1)
ShapeModel = Callable[[Shape, Sample], float]


def _over(value: float | None, limit: float) -> float:
    return 0.0 if value is None else value / limit


def pressure(s: Sample, p: Policy) -> list[tuple[str, str, float, str]]:
    """(role, reason, how far over, detail) for each role under pressure, the most pressed first."""
    out = []
    roles = set(s.replicas)
    prefill, decode = ("prefill", "decode") if "prefill" in roles else ("colocated", "colocated")
    ttft, itl = _over(s.ttft_s, p.ttft_s), _over(s.itl_s, p.itl_s)
    if ttft > 1:
        out.append((prefill, "ttft_slo", ttft, f"TTFT {s.ttft_s * 1e3:.0f} ms > {p.ttft_s * 1e3:.0f} ms"))
    if itl > 1:
        out.append((decode, "itl_slo", itl, f"ITL {s.itl_s * 1e3:.0f} ms > {p.itl_s * 1e3:.0f} ms"))  # type: ignore[operator]
    for role, n in s.replicas.items():
        per = s.waiting.get(role, 0) / max(n, 1)
        if per > p.max_waiting_per_replica:
            why = "queue" if role == "colocated" else f"{role}_queue"
            out.append((role, why, per / p.max_waiting_per_replica, f"{per:.1f} waiting per {role} replica"))
    kv = s.kv_usage.get(decode, 0.0)
    if kv > p.max_kv_usage:
        out.append((decode, "decode_kv", kv / p.max_kv_usage, f"decode KV {kv:.0%} in use"))
    return sorted(out, key=lambda r: -r[2])


def _comfortable(s: Sample, p: Policy) -> bool:
    """Both figures under `low_load` x their SLO; a figure not judged (too few observations) counts
    only while the engines hold at most `low_load` requests per replica: few observations under many
    requests in flight is a slow deployment, not an idle one."""
    judged = [v / limit for v, limit in ((s.ttft_s, p.ttft_s), (s.itl_s, p.itl_s)) if v is not None]
    if any(r > p.low_load for r in judged):
        return False
    if len(judged) == 2:
        return True
    busy = sum(s.running.values()) + sum(s.waiting.values())
    return busy <= p.low_load * sum(s.replicas.values())


def _grow(s: Sample, p: Policy, pressed: list, model: ShapeModel | None) -> Decision:
    """Add a replica of the most pressed role that is below its maximum."""
    open_ = [r for r in pressed if s.replicas[r[0]] < p.bounds[r[0]][1]]
    if not open_:
        role, reason, _, detail = pressed[0]
        return Decision(None, 0, "at_max", f"{detail}; {role} at its maximum")
    if model is not None and len({r[0] for r in open_}) > 1:  # the planner picks between the roles
        scored = [(model({**s.replicas, r[0]: s.replicas[r[0]] + 1}, s), r) for r in open_]
        _, best = max(scored, key=lambda x: x[0])
        if best is not open_[0]:
            return Decision(best[0], 1, best[1], f"{best[3]} (the simulator's pick)")
    role, reason, _, detail = open_[0]
    return Decision(role, 1, reason, detail)


def _shrink(s: Sample, p: Policy, model: ShapeModel | None) -> Decision:
    """Remove a replica of the role with the most headroom over its minimum (the simulator's say)."""
    ratio = {"prefill": _over(s.ttft_s, p.ttft_s), "decode": _over(s.itl_s, p.itl_s)}
    roles = [r for r, n in s.replicas.items() if n > p.bounds[r][0]]
    if not roles:
        return Decision(None, 0, "at_min", "within the SLOs at every role's minimum")
    roles.sort(key=lambda r: (ratio.get(r, 0.0), -s.replicas[r]))
    for role in roles:
        smaller = {**s.replicas, role: s.replicas[role] - 1}
        if model is None or model(smaller, s) >= TARGET:
            return Decision(role, -1, "low_load", f"figures under {p.low_load:.0%} of the SLOs")
    return Decision(None, 0, "planner", "the simulator says no smaller shape holds the SLOs")


def decide(s: Sample, p: Policy, mem: Memory, model: ShapeModel | None = None) -> Decision:
    """The next step (see the module doc); updates `mem` when it changes the shape."""
    pressed = pressure(s, p)
    if not _comfortable(s, p) or pressed:
        mem.comfortable_since = None
    elif mem.comfortable_since is None:
        mem.comfortable_since = s.now
    cooling = s.now - mem.last_change < p.cooldown_s
    if s.pending:
        d = Decision(None, 0, "warming", f"{s.pending} replica(s) starting or draining")
    elif pressed:
        d = _grow(s, p, pressed, model)
        if d.delta and cooling:
            d = Decision(None, 0, "cooldown", f"{d.detail}; last change {s.now - mem.last_change:.0f}s ago")
    elif mem.comfortable_since is None:
        d = Decision(None, 0, "steady", "within the SLOs")
    elif s.now - mem.comfortable_since < p.down_after_s or cooling:
        d = Decision(None, 0, "steady", f"comfortable for {s.now - mem.comfortable_since:.0f}s")
    else:
        d = _shrink(s, p, model)
    if d.delta:
        mem.last_change, mem.comfortable_since = s.now, None
    return d


__all__ = ["REASONS", "Decision", "Memory", "Policy", "Sample", "ShapeModel", "decide", "pressure"]
