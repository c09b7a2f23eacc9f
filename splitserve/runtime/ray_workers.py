"""The Ray router's view of the workers (runtime/ray_serve.py): the replicas listed in the deployment's
registry actor, health-checked over HTTP, each as the `WorkerEndpoint` the router's Dispatcher routes to.
Needs no Ray itself: the registry is any object with async `list` / `unregister` remotes."""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import Any

import httpx
import msgspec

from splitserve.runtime.common import describe_worker
from splitserve.wire.stats import Health, WorkerRow, WorkerStats

log = logging.getLogger(__name__)


@dataclass
class RayEndpoint:
    """A worker as the router sees it (the `WorkerEndpoint` protocol of splitserve.router.dispatch)."""

    id: str
    name: str
    role: str
    url: str
    kv_address: str | None
    node_id: str
    pid: int
    info: dict = field(default_factory=dict)  # the last /health, as /workers shows it
    health: Health | None = None  # the same, decoded
    state: str = "starting"
    inflight: int = 0
    misses: int = 0
    restarts: int = 0
    startup_s: float | None = None  # Serve starts the replicas: not measured here
    epoch: int = 0  # its role epoch: role changes so far (runtime/ray_role.py), stamped on calls
    last_exit: int | None = None
    listed: bool = True  # in the registry; a replica that left it is draining

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    def describe(self) -> dict:
        return describe_worker(self, node_id=self.node_id, role_epoch=self.epoch)


class RayWorkers:
    """The router's view of the workers: the registry, health-checked over HTTP every `interval_s`."""

    def __init__(self, registry: Any, interval_s: float, failures: int, headers: dict[str, str]) -> None:
        self.registry = registry
        self.interval_s = interval_s
        self.failures = failures
        self.endpoints: dict[str, RayEndpoint] = {}
        self.changing: set[str] = set()  # workers changing role (runtime/ray_role.py): their state is its
        self.http = httpx.AsyncClient(timeout=max(1.0, 2 * interval_s), headers=headers)

    def ready(self, role: str) -> list[RayEndpoint]:
        return [e for e in self.endpoints.values() if e.role == role and e.ready]

    def describe(self) -> list[dict]:
        return [e.describe() for e in self.endpoints.values()]

    async def refresh(self) -> None:
        entries = await self.registry.list.remote()
        listed = {entry["id"] for entry in entries}
        for e in self.endpoints.values():  # out of the registry: draining (ray_scale.py), nothing new
            e.listed = e.id in listed
        for entry in entries:
            if entry["id"] not in self.endpoints:
                health = msgspec.convert(entry["info"], Health)
                self.endpoints[entry["id"]] = RayEndpoint(
                    entry["id"],
                    entry["name"],
                    entry["role"],
                    entry["url"],
                    entry["kv_address"],
                    entry["node_id"],
                    entry["pid"],
                    dict(entry["info"]),
                    health,
                    epoch=health.role_epoch,
                )
        await asyncio.gather(*(self._check(e) for e in list(self.endpoints.values())))

    async def _check(self, e: RayEndpoint) -> None:
        if e.name in self.changing:
            return
        try:
            r = await self.http.get(f"{e.url}/health")
            r.raise_for_status()
            e.health = msgspec.json.decode(r.content, type=Health)
            e.info.update(msgspec.to_builtins(e.health))
            e.state, e.misses = ("ready" if e.listed else "draining"), 0
        except (httpx.HTTPError, ValueError):
            e.misses += 1
            e.state = "unreachable"
            if e.misses >= self.failures:  # gone (Serve replaces the replica; the new one registers)
                log.warning("worker %s at %s stopped answering; dropping it", e.name, e.url)
                self.endpoints.pop(e.id, None)
                await self.registry.unregister.remote(e.id)

    async def stats(self) -> list[WorkerRow]:
        async def one(e: RayEndpoint) -> WorkerRow:
            row = WorkerRow(e.name, e.role, e.ready)
            if e.ready:
                try:
                    r = await self.http.get(f"{e.url}/stats")
                    row.stats = msgspec.json.decode(r.content, type=WorkerStats)
                except (httpx.HTTPError, ValueError):
                    pass
            return row

        return list(await asyncio.gather(*(one(e) for e in list(self.endpoints.values()))))

    async def loop(self) -> None:
        while True:
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the watcher must outlive one bad round
                log.exception("refreshing the worker list failed")
            await asyncio.sleep(self.interval_s)


__all__ = ["RayEndpoint", "RayWorkers"]
