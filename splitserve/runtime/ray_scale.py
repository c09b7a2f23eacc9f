"""The scaling controller's hands on the Ray runtime (runtime/ray_serve.py), `scaling.enabled`:

    controller (in the router replica) --desired replicas per role--> registry actor
    Serve's autoscaler, each pool's policy `FollowRegistry` ---------> that count, within the bounds
    a replica Serve stops: `drain_replica` (WorkerReplica.__del__) ----> unregisters (the router routes
        it nothing new: it leaves the ready set at the router's next refresh), waits until its worker
        has had nothing unfinished and no KV export leased for `SETTLE_S` (the router's refresh has
        passed by then) or `scaling.drain_timeout_s`, then lets Serve end it;
        a request still on it then is a worker fault, which the router migrates.
Which replica Serve stops is Serve's choice; every replica drains the same way.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

import httpx
import ray

log = logging.getLogger(__name__)

SETTLE_S = 1.0  # a draining replica is idle once its engine has had nothing in flight this long


class FollowRegistry:
    """A Serve autoscaling policy (`autoscaling_config.policy`): the replica count the controller asked
    for in the registry actor (`desired(role)`), else Serve's current target. It runs in Serve's
    controller, once per autoscaling tick: the read is one small actor call, bounded by `timeout_s`."""

    def __init__(self, registry: str, namespace: str, role: str, timeout_s: float = 1.0) -> None:
        self.registry, self.namespace, self.role, self.timeout_s = registry, namespace, role, timeout_s
        self._actor: Any = None

    def __call__(self, ctx: Any) -> tuple[int, dict]:
        try:
            if self._actor is None:
                self._actor = ray.get_actor(self.registry, namespace=self.namespace)
            want = ray.get(self._actor.desired.remote(self.role), timeout=self.timeout_s)
        except Exception:  # noqa: BLE001 - no answer: keep the count as it is
            self._actor, want = None, None
        return (ctx.target_num_replicas if want is None else int(want)), {}


def autoscaling(manifest: Any, role: str, registry: str) -> dict:
    """A pool's Serve `autoscaling_config` under the controller: its bounds, our policy, no delays
    (the controller has its own cooldown and hysteresis)."""
    from splitserve.config.manifest_scaling import bounds

    pool = getattr(manifest, role)
    lo, hi = bounds(pool.replicas, pool.min_replicas, pool.max_replicas)
    return {
        "min_replicas": lo,
        "max_replicas": hi,
        "initial_replicas": pool.replicas,
        "upscale_delay_s": 0.0,
        "downscale_delay_s": 0.0,
        "policy": {
            "policy_function": f"{__name__}:FollowRegistry",
            "policy_kwargs": {"registry": registry, "namespace": manifest.runtime.namespace, "role": role},
        },
    }


async def drain_replica(registry: Any, replica_id: str, url: str, headers: dict, timeout_s: float) -> None:
    """A stopping replica: out of the registry, then wait until its engine is idle (see the module doc)."""
    try:
        await registry.unregister.remote(replica_id)
    except ray.exceptions.RayActorError:
        return  # the deployment is being deleted: nothing routes here any more
    deadline = time.monotonic() + timeout_s
    idle_since: float | None = None
    async with httpx.AsyncClient(headers=headers, timeout=5) as http:
        while time.monotonic() < deadline:
            try:
                s = (await http.get(f"{url}/stats")).json()
                kv = s.get("kv_transfer") or {}
                leases = (kv.get("transport") or {}).get("leases") or {}
                busy = s["unfinished"] + kv.get("importing", 0) + int(leases.get("active", 0))
            except (httpx.HTTPError, ValueError, KeyError):
                return  # the worker is gone already
            now = time.monotonic()
            idle_since = (idle_since or now) if busy == 0 else None
            if idle_since is not None and now - idle_since >= SETTLE_S:
                return
            await asyncio.sleep(0.1)
    log.warning("replica %s still busy after %.0fs of draining; stopping it (its requests migrate)",
                replica_id, timeout_s)  # fmt: skip


class RayScaler:
    """The controller's `Actuator` on Ray: the serving count from the router's view of the workers,
    the wanted count written to the registry for `FollowRegistry` to apply."""

    def __init__(self, registry: Any, workers: Any, roles: list[str]) -> None:
        self.registry, self.workers, self.roles = registry, workers, roles
        self.wanted: dict[str, int] = {}

    def shape(self) -> tuple[dict[str, int], int]:
        serving = {role: len(self.workers.ready(role)) for role in self.roles}
        draining = sum(e.state == "draining" for e in self.workers.endpoints.values())
        pending = sum(abs(self.wanted[r] - serving[r]) for r in self.wanted if self.wanted[r] != serving[r])
        return serving, pending + draining

    async def _ask(self, role: str, delta: int) -> None:
        want = len(self.workers.ready(role)) + delta
        self.wanted[role] = want
        await self.registry.set_desired.remote(role, want)

    async def add(self, role: str) -> None:
        await self._ask(role, 1)

    async def remove(self, role: str) -> None:
        await self._ask(role, -1)


def ray_controller(manifest: Any, registry: Any, workers: Any, server: Any) -> Any:
    """The scaling controller in the Ray router: on `server`'s metrics (router.server.OpenAIServer)
    and `workers` (runtime/ray_workers.RayWorkers)."""
    from splitserve.scale.controller import Controller, shape_model
    from splitserve.scale.signals import RouterSignals

    sc = manifest.scaling
    scaler = RayScaler(registry, workers, list(manifest.pools()))
    signals = RouterSignals(server.metrics, server.info.served_name, sc.percentile, sc.min_requests,
                            sc.window(), workers.stats, scaler.shape)  # fmt: skip
    return Controller(manifest, signals, scaler, server.metrics.registry, shape_model(manifest))


__all__ = ["FollowRegistry", "RayScaler", "autoscaling", "drain_replica", "ray_controller"]
