"""The manifest's `scaling` section: the SLO-driven controller (splitserve/scale/) that adds and removes
prefill and decode replicas at run time, each pool between its `min_replicas` and `max_replicas`.

    scaling: {enabled: true, interval_s: 5, cooldown_s: 30, down_after_s: 60}
    prefill: {replicas: 1, min_replicas: 1, max_replicas: 3}
    decode:  {replicas: 1, min_replicas: 1, max_replicas: 2}
    slos:    {ttft_ms: 800, itl_ms: 120}                 # what the controller holds the router's figures to
"""

from __future__ import annotations

from pydantic import Field

from splitserve.config.manifest_sections import PositiveFloat, Section


class ScalingSection(Section):
    enabled: bool = False
    interval_s: PositiveFloat = 5.0  # one decision per interval
    window_s: PositiveFloat | None = None  # the figures span the last window_s; null: 3 x interval_s
    # the percentile of TTFT and of ITL (time between two tokens, TPOT's per-token form) held to the SLOs
    percentile: float = Field(default=0.9, gt=0, lt=1)
    # SLOs the controller holds (ms); null: the manifest's `slos` (ttft_ms, itl_ms)
    ttft_ms: PositiveFloat | None = None
    itl_ms: PositiveFloat | None = None
    # after a change, no other change for this long (a new replica warms up before it is judged)
    cooldown_s: float = Field(default=30.0, ge=0, le=86_400)
    # a replica is removed only once both figures have stayed under `low_load` of their SLO this long
    down_after_s: float = Field(default=60.0, ge=0, le=86_400)
    low_load: float = Field(default=0.5, gt=0, lt=1)  # the hysteresis band: between it and 1, hold
    # a window with fewer first tokens (ITL gaps) than this judges no TTFT (ITL)
    min_requests: int = Field(default=3, ge=1)
    # queue and KV pressure add a replica before the SLOs break: waiting requests per replica of a role,
    # and a decode pool's KV blocks in use (0..1)
    max_waiting_per_replica: float = Field(default=8.0, gt=0)
    max_kv_usage: float = Field(default=0.9, gt=0, le=1)
    # a planner profile (`splitserve plan --save-profile`): each step is checked against its simulator
    # (a removal that would break the SLOs is not made; with both SLOs broken, the role it helps most)
    profile: str | None = None
    drain_timeout_s: PositiveFloat = 30.0  # a removed replica's requests get this long to finish

    def window(self) -> float:
        return self.window_s if self.window_s is not None else 3 * self.interval_s


def bounds(replicas: int, lo: int | None, hi: int | None) -> tuple[int, int]:
    """A pool's (min, max) replicas under the controller: given, else 1 and twice `replicas`."""
    low = 1 if lo is None else max(lo, 1)
    return low, max(hi if hi is not None else 2 * replicas, low)


__all__ = ["ScalingSection", "bounds"]
