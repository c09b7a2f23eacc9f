"""A worker that changes role on the Ray runtime: the Ray router's `RoleSwitcher` (runtime/role_switch.py,
whose module doc tells a change's life: checks and 409s, drain, reconfigure with a new role epoch, KV
handshake, rejoin). The steps are the local runtime's; what differs is where the worker is kept:

    workers        the router's `RayWorkers` endpoints (one per Serve replica in the registry)
    new config     the replica's worker config in the new role, on the replica's own node address and
                   device; the replica's actor stays where Serve placed it, serving the worker API at
                   the same address
    not taken      the worker's front end ends its process when a new engine core does not start: Serve's
                   health check then replaces the replica, in its deployment's role
    rejoined       the endpoint's role, epoch, KV address and state change together, then the registry's
                   entry (so that a restarted router reads the new role)
While a replica changes role the router's health rounds leave its state alone. A replica keeps its
deployment (Serve counts it there) and comes back in that deployment's role if Serve replaces it.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any
from urllib.parse import urlparse

import msgspec
from prometheus_client import CollectorRegistry

from splitserve.config.manifest import Manifest
from splitserve.config.worker import WorkerConfig
from splitserve.runtime.common import worker_config
from splitserve.runtime.role_switch import RoleSwitcher
from splitserve.wire.stats import Health

if TYPE_CHECKING:
    from splitserve.runtime.ray_workers import RayEndpoint, RayWorkers


class RayRoleSwitcher(RoleSwitcher):
    """Changes the role of the Ray router's workers; `registry`: the deployment's registry actor."""

    def __init__(
        self, manifest: Manifest, workers: RayWorkers, registry: Any, metrics: CollectorRegistry, model: str
    ) -> None:
        self.ray_workers, self.registry = workers, registry
        rt = manifest.runtime
        self._begin(manifest, workers.http, rt.drain_timeout_s, rt.startup_timeout_s, metrics, model)
        self.changing = workers.changing  # NOTE: shared: the health rounds leave these workers' state alone

    def workers(self) -> list:
        return list(self.ray_workers.endpoints.values())

    def ready(self, role: str) -> list:
        return self.ray_workers.ready(role)

    def new_config(self, w: RayEndpoint, role: str, epoch: int) -> WorkerConfig:  # type: ignore[override]
        """The replica's worker in `role`: that role's engine section and KV side, on its node's address
        and its own device; the worker keeps its secret (the "-" only marks the API as authenticated)."""
        host = urlparse(w.url).hostname or "127.0.0.1"
        new = worker_config(self.manifest, role, 0, "-", host)
        device = w.health.device if w.health is not None else new.engine.device
        engine = dataclasses.replace(new.engine, device=device)
        return dataclasses.replace(new, engine=engine, role_epoch=epoch)

    async def not_taken(self, w: RayEndpoint) -> None:  # type: ignore[override]
        w.state = "unreachable"  # Serve replaces the replica; the health rounds drop it

    async def rejoined(self, w: RayEndpoint, info: Health) -> None:  # type: ignore[override]
        w.info.update(msgspec.to_builtins(info))
        w.health, w.kv_address, w.state = info, info.kv_address, "ready"
        change = {"role": w.role, "kv_address": info.kv_address, "info": dict(w.info)}
        await self.registry.update.remote(w.id, change)


__all__ = ["RayRoleSwitcher"]
