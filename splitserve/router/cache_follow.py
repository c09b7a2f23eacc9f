"""`CacheFollower`: keeps the router's view of each routed replica's prefix cache (cache_index.py) in step
with the replica's own events, by a long poll of its GET /kv/events (wire/kv_events.py).

One task per ready replica of the routed roles (prefill; colocated), started and stopped as replicas
come and go (checked every `SUPERVISE_S`): it asks for the events after the last one applied, which the
worker answers at once when it has some, or after `poll_wait_s` with none (a heartbeat). A page that does
not follow on (a sequence gap, a restart under the same name: another epoch) makes the view resync from a
snapshot. A replica that does not answer (stopped, partitioned, restarting) is not heard from: after
`stale_s` its view is no longer fresh, and routing uses the hash policy for the pick (cache_policy.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable, Sequence
from typing import Protocol

import aiohttp
import msgspec

from splitserve.config.manifest_routing import CacheAwareSection
from splitserve.router.cache_index import ReplicaIndex
from splitserve.router.worker_answers import WorkerEndpoint
from splitserve.wire.kv_events import KVEventsPage

log = logging.getLogger(__name__)

SUPERVISE_S = 0.25  # how often the set of followed replicas is brought in line with the ready ones
RETRY_S = 0.5  # after a failed poll


class ReadyWorkers(Protocol):
    def ready(self, role: str) -> Sequence[WorkerEndpoint]: ...


class CacheFollower:
    def __init__(
        self,
        workers: ReadyWorkers,
        roles: tuple[str, ...],
        config: CacheAwareSection,
        headers: dict[str, str] | None = None,
        connect_s: float = 5.0,
    ) -> None:
        self.workers = workers
        self.roles = roles
        self.config = config
        self.headers = headers or {}
        self.connect_s = connect_s
        self.indexes: dict[str, ReplicaIndex] = {}
        self.on_index: Callable[[ReplicaIndex], None] | None = None  # a new replica's view (metrics)
        self.on_resync: Callable[[str, str], None] | None = None  # (worker, why)
        self._tasks: dict[str, tuple[str, asyncio.Task]] = {}  # worker name -> (its url, its poll)
        self._main: asyncio.Task | None = None
        self._session: aiohttp.ClientSession | None = None

    def start(self) -> None:
        """From the event loop that serves (idempotent)."""
        if self._main is None:
            self._main = asyncio.create_task(self._supervise(), name="cache-follower")

    async def stop(self) -> None:
        tasks = [t for _, t in self._tasks.values()] + ([self._main] if self._main else [])
        for t in tasks:
            t.cancel()
        for t in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._tasks.clear()
        if self._session is not None:
            await self._session.close()

    def index(self, name: str) -> ReplicaIndex:
        idx = self.indexes.get(name)
        if idx is None:
            idx = self.indexes[name] = ReplicaIndex(name)
            if self.on_index is not None:
                self.on_index(idx)
        return idx

    def fresh(self, name: str, now: float | None = None) -> bool:
        idx = self.indexes.get(name)
        now = time.monotonic() if now is None else now
        return idx is not None and idx.fresh(now, self.config.stale_s)

    async def _supervise(self) -> None:
        while True:
            try:
                self._sync_tasks()
            except Exception:  # noqa: BLE001 - the follower must outlive one bad round
                log.exception("cache follower: supervising failed")
            await asyncio.sleep(SUPERVISE_S)

    def _sync_tasks(self) -> None:
        ready = {w.name: w.url for role in self.roles for w in self.workers.ready(role) if w.url}
        for name, (url, task) in list(self._tasks.items()):
            if ready.get(name) != url or task.done():
                task.cancel()
                del self._tasks[name]
        for name, url in ready.items():
            if name not in self._tasks:
                task = asyncio.create_task(self._follow(self.index(name), url), name=f"cache-follow-{name}")
                self._tasks[name] = (url, task)

    @property
    def http(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(headers=self.headers)
        return self._session

    async def poll(self, idx: ReplicaIndex, url: str) -> KVEventsPage:
        """One page of `url`'s events after what `idx` holds (a snapshot when it holds nothing)."""
        wait = self.config.poll_wait_s
        params = {"epoch": idx.epoch, "after": str(idx.seq), "wait_s": str(wait)}
        timeout = aiohttp.ClientTimeout(total=wait + self.connect_s + 5, sock_connect=self.connect_s)
        async with self.http.get(f"{url}/kv/events", params=params, timeout=timeout) as resp:
            body = await resp.read()
            if resp.status != 200:
                raise RuntimeError(f"GET /kv/events answered {resp.status}: {body[:200]!r}")
        return msgspec.json.decode(body, type=KVEventsPage)

    async def _follow(self, idx: ReplicaIndex, url: str) -> None:
        failed = False
        while True:
            try:
                page = await self.poll(idx, url)
            except (aiohttp.ClientError, TimeoutError, RuntimeError, msgspec.DecodeError) as exc:
                if not failed:
                    log.info("cache follower: %s: %s (retrying)", idx.name, exc)
                failed = True
                await asyncio.sleep(RETRY_S)
                continue
            failed = False
            why = idx.apply(page, time.monotonic())
            if why is not None:
                log.info("cache follower: %s: view %s (%s, seq %d, %d blocks)", idx.name,
                         "dropped" if why == "gap" else "rebuilt", why, idx.seq, len(idx.stored))  # fmt: skip
                if self.on_resync is not None:
                    self.on_resync(idx.name, why)


__all__ = ["CacheFollower", "ReadyWorkers"]
