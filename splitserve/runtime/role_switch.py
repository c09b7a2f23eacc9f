"""A worker that changes role at run time: prefill <-> decode, keeping its name (the local runtime here;
the Ray runtime supplies its own side of it in runtime/ray_role.py).

`RoleSwitcher.switch(name, RoleChangeRequest(role=...))` is the one entry point: the router's admin
route (POST /admin/workers/{name}/role) calls it, and so may a scaling controller (as
`LocalRuntime.change_role`, set where `splitserve serve` makes the switcher). A change's life:
  1. checked: the worker exists, is ready, is not changing role already, has the other role; and it is
     not the last ready worker of its role (unless `force`): each refusal a 409 (404 unknown worker);
  2. drain: the worker leaves the router's ready set at once (no new work) and starts its next engine
     core's imports (POST /role/prepare); the switch waits until the router has nothing on it and the
     worker reports no request unfinished and no KV export still leased, or until the drain deadline
     (`drain_timeout_s`, default `runtime.drain_timeout_s`);
  3. reconfigure: its role and role epoch (+1) change, and its command line with them (a restart from
     now on starts it in its new role); the worker is sent its new config (POST /role: the new role's
     engine section and batch budget, the new role's side of the KV transport: a prefill worker
     listens, a decode worker fetches) and restarts its engine core with it, keeping its front end and
     address. A restart, not an edit of the running engine: what a role gets is fixed when its core is
     built (the KV pool's size from the role's engine section, and where the pool lives: a prefill
     worker's `shm` transport lends it from shared memory; the transport's listening or fetching side;
     the batch limits), and the weights load from the host's cache in a fraction of a second. What was
     still in flight at the deadline fails there as `role_changed`, which the router migrates;
  4. rejoin: the KV handshake is checked between the worker and each ready worker of the other role,
     then the worker is ready again in its new role: role, epoch, KV address and state change together,
     between two awaits, so the router never sees half of it.
Calls the router made under the old role or epoch answer 409 (`stale_role`) and are picked again
(router/migrate.py). Each change is logged (one line: reason and seconds per phase) and counted
(`splitserve:worker_role_changes` by outcome, `splitserve:worker_role_change_seconds` by phase,
`splitserve:worker_role_epoch`). A worker whose reconfigure fails is killed: the runtime restarts it
in its new role. Flags in `runtime.worker_args` reach a restarted worker, not a reconfigured core.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from typing import TYPE_CHECKING

import httpx
import msgspec
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from splitserve.config.manifest import Manifest
from splitserve.config.worker import WorkerConfig
from splitserve.router.openai_protocol import APIError
from splitserve.runtime.common import config_argv, worker_config
from splitserve.wire.http import PeerRequest
from splitserve.wire.role import RoleChangeRequest, RoleChangeResult, RoleSwitch
from splitserve.wire.stats import Health, WorkerStats

if TYPE_CHECKING:
    from splitserve.runtime.local import LocalRuntime, WorkerProcess

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a drain looks at the worker
PHASES = ("drain", "reconfigure", "rejoin")


def switched_config(
    manifest: Manifest, name: str, role: str, epoch: int, core_share: str | None
) -> WorkerConfig:
    """Worker `name`'s config in `role` at `epoch`: that role's engine section and transport side, on the
    worker's own device and slot of lent cores (those of the pool it started in)."""
    home, _, index = name.rpartition("-")
    own = worker_config(manifest, home, int(index), "-", "127.0.0.1", core_share)
    new = worker_config(manifest, role, int(index), "-", "127.0.0.1", None)
    pace = manifest.runtime.decode_pace_ms
    pace = manifest.slos.itl_ms if pace is None else pace
    return dataclasses.replace(
        new, engine=dataclasses.replace(new.engine, device=own.engine.device), core_share=own.core_share,
        core_slot=own.core_slot, core_total=own.core_total, role_epoch=epoch,
        decode_pace_s=pace / 1e3 if own.core_share and role == "decode" else 0.0,
    )  # fmt: skip


class _Metrics:
    def __init__(self, registry: CollectorRegistry, model: str) -> None:
        self.model = model
        labels = ["model_name", "worker", "from_role", "to_role", "outcome"]
        self.changes = Counter("splitserve:worker_role_changes", "Workers' role changes, by outcome", labels,
                               registry=registry)  # fmt: skip
        self.seconds = Histogram("splitserve:worker_role_change_seconds", "Seconds of each phase of a role "
                                 "change", ["model_name", "phase"], registry=registry,
                                 buckets=(0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 30, 60, 120))  # fmt: skip
        self.epoch = Gauge("splitserve:worker_role_epoch", "A worker's role changes so far",
                           ["model_name", "worker"], registry=registry)  # fmt: skip


class RoleSwitcher:
    """Changes workers' roles in a `LocalRuntime` (see the module doc). What differs on another runtime
    is in the few methods under "the runtime's side" (runtime/ray_role.py: the Ray runtime's)."""

    def __init__(
        self, runtime: LocalRuntime, registry: CollectorRegistry | None = None, model: str = ""
    ) -> None:
        self.runtime, rt = runtime, runtime.rt
        self._begin(
            runtime.manifest, runtime._http, rt.drain_timeout_s, rt.startup_timeout_s, registry, model
        )

    def _begin(self, manifest: Manifest, http: httpx.AsyncClient, drain_timeout_s: float,
               startup_timeout_s: float, registry: CollectorRegistry | None, model: str) -> None:  # fmt: skip
        """`http`: the worker API's client (its bearer token set)."""
        self.manifest, self.http = manifest, http
        self.drain_timeout_s, self.startup_timeout_s = drain_timeout_s, startup_timeout_s
        self.metrics = _Metrics(registry if registry is not None else CollectorRegistry(), model)
        self.changing: set[str] = set()  # workers whose role is changing now
        for w in self.workers():
            self.metrics.epoch.labels(model, w.name).set(w.epoch)

    # the runtime's side: its workers, the new config, a failed reconfigure, the worker rejoining

    def workers(self) -> list:
        return self.runtime.workers

    def ready(self, role: str) -> list:
        return self.runtime.ready(role)

    def new_config(self, w: WorkerProcess, role: str, epoch: int) -> WorkerConfig:
        """`w`'s config in `role`; its command line follows (a restart starts it in its new role)."""
        config = switched_config(self.manifest, w.name, role, epoch, self.runtime.core_share)
        w.argv = config_argv(self.manifest, config, self.manifest.transport.secret_env)
        return config

    async def not_taken(self, w: WorkerProcess) -> None:
        """`w` did not take its new role: killed, the runtime restarts it in that role."""
        w.state = "restarting"
        if w.proc is not None:
            await self.runtime._kill(w.proc)

    async def rejoined(self, w: WorkerProcess, info: Health) -> None:
        """`w` serves its new role: role, epoch, KV address and state as one change (no await between)."""
        w.info, w.health = {**w.info, **msgspec.to_builtins(info)}, info
        w.kv_address, w.state = info.kv_address, "ready"

    async def switch(self, name: str, change: RoleChangeRequest) -> RoleChangeResult:
        """Move worker `name` to `change.role`; -> how it went. Raises APIError (404, 409, 502). A
        caller that goes away does not stop a change under way."""
        w = self._check(name, change)
        w.state = "draining"  # NOTE: in the same turn as the checks: no pick, no second change, in between
        self.changing.add(name)
        return await asyncio.shield(asyncio.create_task(self._run(w, change)))

    async def _run(self, w: WorkerProcess, change: RoleChangeRequest) -> RoleChangeResult:
        name, start, from_role = w.name, time.perf_counter(), w.role
        outcome = "failed"
        try:
            timeout = change.drain_timeout_s or self.drain_timeout_s
            left = await self._drain(w, timeout)
            drained = time.perf_counter()
            info = await self._reconfigure(w, change.role)
            reconfigured = time.perf_counter()
            await self._rejoin(w, info)
            outcome = "ok"
        except BaseException:
            if w.state == "draining":  # nothing changed yet: back to work in its role
                w.state = "ready"
            raise
        finally:
            self.changing.discard(name)
            self.metrics.changes.labels(self.metrics.model, name, from_role, change.role, outcome).inc()
        result = RoleChangeResult(
            worker=name, from_role=from_role, to_role=w.role, epoch=w.epoch, reason=change.reason,
            forced=change.force, drain_s=drained - start, reconfigure_s=reconfigured - drained,
            rejoin_s=time.perf_counter() - reconfigured, migrated=left,
        )  # fmt: skip
        for phase in PHASES:
            self.metrics.seconds.labels(self.metrics.model, phase).observe(getattr(result, f"{phase}_s"))
        self.metrics.epoch.labels(self.metrics.model, name).set(w.epoch)
        log.warning("worker %s changed role %s -> %s (epoch %d, reason: %s%s): drain %.2fs (%d handed on), "
                    "reconfigure %.2fs, rejoin %.2fs", name, from_role, w.role, w.epoch, change.reason,
                    ", forced" if change.force else "", result.drain_s, left, result.reconfigure_s,
                    result.rejoin_s)  # fmt: skip
        return result

    def _check(self, name: str, change: RoleChangeRequest) -> WorkerProcess:
        w = next((x for x in self.workers() if x.name == name), None)
        if w is None:
            raise APIError(404, f"no worker is named {name!r}", code="worker_not_found")
        refusal = None
        if self.manifest.mode != "disaggregated" or w.role not in ("prefill", "decode"):
            refusal = f"{name} is a {w.role} worker: only prefill and decode workers change role"
        elif name in self.changing:
            refusal = f"{name} is changing role already"
        elif w.role == change.role:
            refusal = f"{name} is a {w.role} worker already"
        elif not w.ready:
            refusal = f"{name} is not ready ({w.state})"
        elif not change.force and not [x for x in self.ready(w.role) if x is not w]:
            refusal = f"{name} is the last ready {w.role} worker: the change would leave none (force it)"
        if refusal is not None:
            raise APIError(409, refusal, type="invalid_request_error", code="role_change_refused")
        return w

    async def _drain(self, w: WorkerProcess, timeout_s: float) -> int:
        """Until nothing is on `w` (router side and worker side), or `timeout_s`; -> what is left."""
        deadline = time.monotonic() + timeout_s
        with contextlib.suppress(httpx.HTTPError):  # a head start only
            await self.http.post(f"{w.url}/role/prepare", timeout=10)
        while True:
            unfinished, leased = await self._busy(w)
            left = max(w.inflight, unfinished) + leased
            if left == 0 or time.monotonic() >= deadline:
                return left
            await asyncio.sleep(POLL_S)

    async def _busy(self, w: WorkerProcess) -> tuple[int, int]:
        """The worker's requests unfinished, and its KV exports still leased (a decode worker may yet
        fetch them)."""
        try:
            r = await self.http.get(f"{w.url}/stats", timeout=30)
            r.raise_for_status()
            stats = msgspec.json.decode(r.content, type=WorkerStats)
        except (httpx.HTTPError, ValueError):
            return 0, 0  # gone: its requests are failing over already
        transport = stats.kv_transfer.transport if stats.kv_transfer is not None else {}  # diagnostics
        leases = transport.get("leases") or {}
        return stats.unfinished, int(leases.get("active", 0))

    async def _reconfigure(self, w: WorkerProcess, role: str) -> Health:
        """The worker's new role in its engine core (and the runtime's record); -> its health."""
        epoch = w.epoch + 1
        config = self.new_config(w, role, epoch)
        w.role, w.epoch, w.state = role, epoch, "switching"
        body = msgspec.json.encode(RoleSwitch(spec=config.to_json(include_secret=False)))
        try:
            r = await self.http.post(f"{w.url}/role", content=body, timeout=self.startup_timeout_s)
            r.raise_for_status()
            return msgspec.json.decode(r.content, type=Health)
        except (httpx.HTTPError, ValueError) as exc:
            log.error("worker %s did not take the %s role (%s); restarting it", w.name, role, exc)
            await self.not_taken(w)
            raise APIError(502, f"{w.name} did not take the {role} role ({exc}); it restarts",
                           type="server_error", code="role_change_failed") from None  # fmt: skip

    async def _rejoin(self, w: WorkerProcess, info: Health) -> None:
        """Check the KV handshake with each ready worker of the other role, then make `w` ready."""
        pairs = [(w, p.kv_address) for p in self.ready("prefill")] if w.role == "decode" else [
            (d, info.kv_address) for d in self.ready("decode")]  # fmt: skip
        for decode, address in pairs:
            body = msgspec.json.encode(PeerRequest(address=address or "", timeout_s=5.0))
            try:
                r = await self.http.post(f"{decode.url}/kv/connect", content=body, timeout=10)
                r.raise_for_status()
            except httpx.HTTPError as exc:  # the fetch will say so again, and the router migrates
                log.warning("worker %s: KV handshake %s -> %s failed on rejoining: %s", w.name, decode.name,
                            address, exc)  # fmt: skip
        await self.rejoined(w, info)


__all__ = ["PHASES", "RoleSwitcher", "switched_config"]
