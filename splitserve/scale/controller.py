"""The scaling controller: every `scaling.interval_s`, read the router's figures (signals.py), decide
(decide.py), and hand an add or a removal of one replica to the runtime's `Actuator`:

    local   runtime/local_scale.py: a worker process more, or one drained and stopped
    ray     runtime/ray_scale.py: the Serve deployment's target replica count, drained on removal

Every decision is logged with its reason (a change at INFO, a hold at DEBUG when it repeats) and
exported on the router's /metrics:
    splitserve:scaling_desired_replicas{role}     what the controller last asked for
    splitserve:scaling_current_replicas{role}     replicas serving now
    splitserve:scaling_decisions_total{role, action, reason}   add | remove | hold, by reason
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING, Protocol

from prometheus_client import CollectorRegistry, Counter, Gauge

from splitserve.config.manifest_scaling import bounds
from splitserve.scale.decide import Decision, Memory, Policy, Sample, ShapeModel, decide

if TYPE_CHECKING:
    from splitserve.config.manifest import Manifest
    from splitserve.scale.signals import RouterSignals

log = logging.getLogger(__name__)


class Actuator(Protocol):
    """A runtime's hands: `shape()` -> (serving replicas per role, replicas starting or draining)."""

    def shape(self) -> tuple[dict[str, int], int]: ...

    async def add(self, role: str) -> None: ...

    async def remove(self, role: str) -> None: ...


def policy(manifest: Manifest) -> Policy:
    """The controller's policy from the manifest: `scaling`'s knobs, its SLOs (else `slos`), the pools'
    min/max replicas."""
    sc = manifest.scaling
    ttft_ms = sc.ttft_ms if sc.ttft_ms is not None else manifest.slos.ttft_ms
    itl_ms = sc.itl_ms if sc.itl_ms is not None else manifest.slos.itl_ms
    return Policy(
        ttft_s=ttft_ms / 1e3,
        itl_s=itl_ms / 1e3,
        bounds={r: bounds(p.replicas, p.min_replicas, p.max_replicas) for r, p in manifest.pools().items()},
        cooldown_s=sc.cooldown_s,
        down_after_s=sc.down_after_s,
        low_load=sc.low_load,
        max_waiting_per_replica=sc.max_waiting_per_replica,
        max_kv_usage=sc.max_kv_usage,
    )


def shape_model(manifest: Manifest) -> ShapeModel | None:
    """The planner's simulator on `scaling.profile`, when one is given."""
    if manifest.scaling.profile is None:
        return None
    from splitserve.scale.model import from_manifest

    p = policy(manifest)
    e = manifest.engine
    return from_manifest(manifest.scaling.profile, p.ttft_s * 1e3, p.itl_s * 1e3, e.block_size,
                         e.enable_prefix_caching)  # fmt: skip


class Controller:
    def __init__(
        self,
        manifest: Manifest,
        signals: RouterSignals,
        actuator: Actuator,
        registry: CollectorRegistry,
        model: ShapeModel | None = None,
    ) -> None:
        self.policy = policy(manifest)
        self.interval_s = manifest.scaling.interval_s
        self.signals, self.actuator, self.model = signals, actuator, model
        self.memory = Memory()
        self.roles = list(manifest.pools())
        self.desired = Gauge("splitserve:scaling_desired_replicas", "Replicas the scaling controller wants",
                             ["role"], registry=registry)  # fmt: skip
        self.current = Gauge("splitserve:scaling_current_replicas", "Replicas serving, per role", ["role"],
                             registry=registry)  # fmt: skip
        self.decisions = Counter("splitserve:scaling_decisions", "Scaling decisions by role, action, reason",
                                 ["role", "action", "reason"], registry=registry)  # fmt: skip
        replicas, _ = actuator.shape()
        for role in self.roles:
            self.desired.labels(role).set(replicas.get(role, 0))
            self.current.labels(role).set(replicas.get(role, 0))
        self.history: list[tuple[Sample, Decision]] = []  # the decisions made (kept for /admin, tests)
        self._task: asyncio.Task | None = None
        self._changes: set[asyncio.Task] = set()
        self._last_reason = ""

    async def step(self) -> Decision:
        """One interval: read, decide, act (the add or removal runs on in the background)."""
        sample = await self.signals.sample(time.monotonic())
        d = decide(sample, self.policy, self.memory, self.model)
        for role in self.roles:
            self.current.labels(role).set(sample.replicas.get(role, 0))
        self.decisions.labels(d.role or "", d.action, d.reason).inc()
        self.history.append((sample, d))
        del self.history[:-1000]
        if d.role is not None:
            want = sample.replicas[d.role] + d.delta
            self.desired.labels(d.role).set(want)
            log.info("scaling: %s a %s replica (-> %d): %s [%s]", d.action, d.role, want, d.detail, d.reason)
            act = self.actuator.add if d.delta > 0 else self.actuator.remove
            task = asyncio.create_task(self._apply(act, d.role))
            self._changes.add(task)
            task.add_done_callback(self._changes.discard)
        elif d.reason != self._last_reason:
            log.info("scaling: hold: %s [%s]", d.detail, d.reason)
        else:
            log.debug("scaling: hold: %s [%s]", d.detail, d.reason)
        self._last_reason = d.reason
        return d

    @staticmethod
    async def _apply(act, role: str) -> None:  # noqa: ANN001
        try:
            await act(role)
        except Exception:  # noqa: BLE001 - a failed start or drain is logged; the next interval re-decides
            log.exception("scaling: changing the %s pool failed", role)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.step()
            except Exception:  # noqa: BLE001 - the controller must outlive one bad interval
                log.exception("scaling: an interval failed")

    def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="scaling")

    async def stop(self) -> None:
        for task in [self._task, *self._changes]:
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError, Exception):
                    await task
        self._task = None


__all__ = ["Actuator", "Controller", "policy", "shape_model"]
