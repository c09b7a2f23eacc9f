"""The scaling controller's hands on the local runtime (scale/controller.py's `Actuator`): a worker process
more for a role, or one drained and stopped.

    add(role)      a new worker `<role>-<n>` (the next free index) is spawned as at start-up, watched and
                   restarted like the others; the router routes to it once it is ready.
    remove(role)   the worker of `role` with the fewest requests in flight (the newest on a tie) turns
                   `retiring`: the router sends it nothing new (it is not ready), its requests in flight
                   finish; once nothing is on it (the router's count, the worker's unfinished requests
                   and its KV exports still leased: a decode worker may yet fetch them) or
                   `drain_timeout_s` passed, it is stopped (SIGTERM, then SIGKILL) and leaves the worker
                   list. A request still on it then is a worker fault: the router migrates it.
A role always keeps one worker; the controller keeps it within its pool's bounds.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import TYPE_CHECKING

import httpx

from splitserve.runtime.common import worker_argv

if TYPE_CHECKING:
    from splitserve.runtime.local import LocalRuntime, WorkerProcess

log = logging.getLogger(__name__)

POLL_S = 0.1  # how often a drain looks at the worker
# the controller waits while a worker is in one of these (role_switch.py's states among them)
UNSETTLED = ("new", "starting", "restarting", "draining", "switching", "retiring")


class LocalScaler:
    def __init__(self, runtime: LocalRuntime, drain_timeout_s: float) -> None:
        self.rt = runtime
        self.drain_timeout_s = drain_timeout_s

    def shape(self) -> tuple[dict[str, int], int]:
        serving = {role: len(self.rt.ready(role)) for role in self.rt.manifest.pools()}
        pending = sum(w.state in UNSETTLED for w in self.rt.workers)
        return serving, pending

    async def _left(self, w: WorkerProcess) -> int:
        """What is still on `w`: requests in flight or unfinished, and KV exports still leased."""
        try:
            r = await self.rt._http.get(f"{w.url}/stats", timeout=30)
            r.raise_for_status()
            stats = r.json()
        except (httpx.HTTPError, ValueError):
            return 0  # gone: its requests are failing over already
        leases = ((stats.get("kv_transfer") or {}).get("transport") or {}).get("leases") or {}
        return max(w.inflight, int(stats.get("unfinished", 0))) + int(leases.get("active", 0))

    def _next_name(self, role: str) -> tuple[str, int]:
        taken = {int(w.name.rsplit("-", 1)[1]) for w in self.rt.workers if w.role == role}
        index = next(i for i in range(len(taken) + 1) if i not in taken)
        return f"{role}-{index}", index

    async def add(self, role: str) -> WorkerProcess:
        from splitserve.runtime.local import StartupError, WorkerProcess

        rt = self.rt
        name, index = self._next_name(role)
        argv = worker_argv(rt.manifest, role, index, rt.manifest.transport.secret_env, rt.core_share)
        w = WorkerProcess(name, role, argv, rt.env)
        rt.workers.append(w)
        try:
            await rt._spawn(w)
        except StartupError:
            rt.workers.remove(w)
            raise
        rt.watch(w)
        rt.on_event("added", w)
        return w

    async def remove(self, role: str) -> WorkerProcess | None:
        ready = self.rt.ready(role)
        if len(ready) <= 1:
            return None
        w = min(reversed(ready), key=lambda x: x.inflight)
        w.state = "retiring"  # NOTE: in the same turn as the pick: the router picks it no more
        log.info("draining worker %s (%d in flight)", w.name, w.inflight)
        deadline = time.monotonic() + self.drain_timeout_s
        while (left := await self._left(w)) and time.monotonic() < deadline:
            await asyncio.sleep(POLL_S)
        if left:
            log.warning("worker %s still had %d requests after %.0fs; stopping it (they migrate)",
                        w.name, left, self.drain_timeout_s)  # fmt: skip
        w.state = "stopped"
        if w.proc is not None and w.proc.returncode is None:
            await self.rt._kill(w.proc)
        self.rt.workers.remove(w)
        self.rt.on_event("removed", w)
        log.info("worker %s removed", w.name)
        return w


def local_controller(manifest, runtime: LocalRuntime, api, stats):  # noqa: ANN001, ANN201
    """The scaling controller of a local deployment (`scaling.enabled`), on the router `api`'s metrics
    (router.server.OpenAIServer) and the workers' /stats (`stats()`); start() it once serving."""
    from splitserve.scale.controller import Controller, shape_model
    from splitserve.scale.signals import RouterSignals

    sc = manifest.scaling
    scaler = LocalScaler(runtime, sc.drain_timeout_s)
    signals = RouterSignals(api.metrics, api.info.served_name, sc.percentile, sc.min_requests,
                            sc.window(), stats, scaler.shape)  # fmt: skip
    return Controller(manifest, signals, scaler, api.metrics.registry, shape_model(manifest))


__all__ = ["LocalScaler", "local_controller"]
