"""The local runtime (the embedded default): every worker its own OS process on this host.

Life of a worker:
  1. spawned as `python -m splitserve.worker.main --role ... --port 0` (the OS picks every port; the
     shm socket lives in a fresh temp dir), with the deployment's KV secret in its environment and
     PR_SET_PDEATHSIG set, so that no worker outlives a runtime that was killed;
  2. ready when it prints its `{"event": "ready", ...}` line (weights loaded, HTTP listening); its
     stderr is forwarded line by line, prefixed with its name;
  3. watched: a process that exits, or misses `health_failures` health checks in a row, is killed and
     restarted after a backoff (doubling from `restart_backoff_s` to `restart_backoff_max_s`, reset
     once it has stayed up for a minute), at most `max_restarts` times;
  4. stopped on shutdown: SIGTERM, then SIGKILL after a grace period.
While a worker is not ready the router does not send it requests; `workers` is what the router reads.
"""

from __future__ import annotations

import asyncio
import logging
import os
import secrets
import shutil
import sys
import time
from collections import deque
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import httpx
import msgspec
from tqdm.auto import tqdm  # here, not at start(): an import there would hold up the router's 503s

from splitserve.config.manifest import Manifest
from splitserve.logs import worker_line
from splitserve.runtime import zygote as forks
from splitserve.runtime.common import core_share_file, describe_worker, worker_argv
from splitserve.runtime.mps import MpsDaemon, MpsPlan
from splitserve.runtime.mps import plan as mps_plan
from splitserve.runtime.standby import Standby, die_with_parent, kill, spawn_standby, taken_or_dead
from splitserve.tempdirs import CORE_SOCKETS, sweep_stale
from splitserve.wire.auth import worker_headers
from splitserve.wire.lifecycle import Launch, ReadyLine
from splitserve.wire.role import RoleChangeRequest, RoleChangeResult
from splitserve.wire.stats import Health

log = logging.getLogger(__name__)

STABLE_S = 60.0  # a worker up this long has its restart backoff reset


class StartupError(RuntimeError):
    """A worker could not start (its last stderr lines are in the message)."""


class _Event(msgspec.Struct):
    """The event a worker's JSON line names (`ReadyLine`, `StandbyLine`), read before the whole line."""

    event: str = ""


_EVENT = msgspec.json.Decoder(_Event)


@dataclass
class WorkerProcess:
    """One worker as the router and runtime see it."""

    name: str  # "prefill-0"
    role: str
    argv: list[str]
    env: dict[str, str] = field(repr=False)
    # new | starting | ready | restarting | failed | stopped | draining | switching (role_switch.py)
    # | retiring (drained for removal, local_scale.py)
    state: str = "new"
    url: str | None = None
    kv_address: str | None = None
    info: dict = field(default_factory=dict)  # the worker's ready line / last /health, as /workers shows it
    health: Health | None = None  # the same, decoded: what the runtime and the router read
    proc: asyncio.subprocess.Process | None = None
    restarts: int = 0
    started_at: float = 0.0
    ready_at: float = 0.0
    startup_s: float | None = None  # the last spawn -> ready time
    last_exit: int | None = None
    inflight: int = 0  # the router's count of requests on this worker
    epoch: int = 0  # its role epoch: role changes so far (runtime/role_switch.py), stamped on calls
    stderr_tail: deque[str] = field(default_factory=lambda: deque(maxlen=40))

    @property
    def ready(self) -> bool:
        return self.state == "ready"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def describe(self) -> dict:
        return describe_worker(self, role_epoch=self.epoch)


@dataclass
class _Owner:
    owner: WorkerProcess | None


class LocalRuntime:
    def __init__(self, manifest: Manifest, on_event: Callable[[str, WorkerProcess], None] | None = None,
                 zygote: forks.Zygote | None = None):  # fmt: skip
        self.manifest = manifest
        self.rt = manifest.runtime
        self.on_event = on_event or (lambda _kind, _w: None)
        secret_env = manifest.transport.secret_env
        secret = manifest.transport.secret or os.environ.get(secret_env) or secrets.token_hex(32)
        env = self.env = {**os.environ, secret_env: secret, "PYTHONUNBUFFERED": "1"}
        self.worker_headers = worker_headers(secret)  # the worker API's bearer token, from the secret
        self.core_share = core_share_file(manifest)  # idle CPU workers lend their cores through it
        share = self.core_share
        self.workers: list[WorkerProcess] = [
            WorkerProcess(f"{role}-{i}", role, worker_argv(manifest, role, i, secret_env, share), env)
            for role, pool in manifest.pools().items()
            for i in range(pool.replicas)
        ]
        self._tasks: list[asyncio.Task] = []
        self._stopping = False
        self._standby: Standby | None = None  # a warm spare process for the next restart (standby.py)
        self._keeper: asyncio.Task | None = None  # keeps one spare (`_keep_standby`) once started
        self._spawning: asyncio.Task | None = None  # the spare being started (its imports under way)
        self._standby_taken = asyncio.Event()  # a restart took the spare: make the next one
        self._http = httpx.AsyncClient(timeout=httpx.Timeout(5.0), headers=self.worker_headers)
        self.mps: MpsPlan | None = None  # what start() decided about CUDA MPS (runtime/mps.py)
        self._mps_daemon: MpsDaemon | None = None
        self.zygote = zygote  # the engine-core fork server (runtime/zygote.py), if begun already
        # a worker's role change (runtime/role_switch.py), once launch.py made it: for a scaling controller
        self.change_role: Callable[[str, RoleChangeRequest], Awaitable[RoleChangeResult]] | None = None

    def ready(self, role: str) -> list[WorkerProcess]:
        return [w for w in self.workers if w.role == role and w.ready]

    def coming(self, role: str) -> bool:
        """Whether a worker of `role` is ready or on its way (starting, restarting): the router waits."""
        return not self._stopping and any(w.role == role and w.state not in ("failed", "stopped")
                                          for w in self.workers)  # fmt: skip

    # ---- start ----------------------------------------------------------------------------------

    async def start(self, progress: bool = True) -> None:
        """Spawn every worker and wait until all are ready; raises StartupError if one fails."""
        self._start_mps()
        if self.zygote is None and forks.wanted(self.manifest, self.env):
            self.zygote = forks.start_zygote(self.env)
        if self.zygote is not None:
            self.env.update(self.zygote.env)  # the cores of workers, spare and restarts are its forks
        bar = tqdm(
            total=len(self.workers),
            desc="starting workers (loading weights)",
            unit="worker",
            disable=not progress,
            file=sys.stderr,
        )
        try:
            async with asyncio.TaskGroup() as group:
                for w in self.workers:
                    group.create_task(self._first_start(w, bar))
        except* StartupError as eg:
            await self.stop()
            raise eg.exceptions[0] from None
        finally:
            bar.close()
        for w in self.workers:
            self.watch(w)

    def watch(self, w: WorkerProcess) -> None:
        """Watch a started worker: restart it when it exits (unless it was drained away)."""
        self._tasks.append(asyncio.create_task(self._watch(w), name=f"watch-{w.name}"))

    def start_standby(self) -> None:
        """Start the warm spare (`runtime.standby`) unless there is one; `splitserve serve` calls it a
        little after ready, so that the spare's imports take no CPU from the start and first requests
        (a restart before then starts it at once, and adopts it)."""
        idle = self._keeper is None or self._keeper.done()
        if self.rt.standby and not self._stopping and idle:
            self._keeper = asyncio.create_task(self._keep_standby(), name="standby")

    def _start_mps(self) -> None:
        """Workers that share a GPU get a private CUDA MPS daemon (`runtime.cuda_mps`), through the
        environment every worker (and the standby) is spawned with."""
        try:
            self.mps = mps_plan(self.manifest, self.env)
            if self.mps.start:
                self._mps_daemon = MpsDaemon()
                self.env.update(self._mps_daemon.start())
        except RuntimeError as exc:
            raise StartupError(f"CUDA MPS: {exc}") from None
        if self.mps.devices:
            log.info("CUDA MPS: %s (%s)", "on" if self.mps.start else "off", self.mps.why)

    async def _first_start(self, w: WorkerProcess, bar: object) -> None:
        await self._spawn(w)
        bar.update(1)  # type: ignore[attr-defined]
        bar.set_postfix_str(f"{w.name} ready in {w.startup_s:.1f}s")  # type: ignore[attr-defined]

    async def _spawn(self, w: WorkerProcess, restart: bool = False) -> None:
        w.state, w.url, w.kv_address = "starting", None, None
        w.started_at = time.monotonic()
        if restart:  # the spare, or one half way (still ahead of a fresh process)
            self.start_standby()
            await asyncio.sleep(0)  # a keeper just started begins its spare's spawn
            if self._standby is None and self._spawning is not None and not self._spawning.done():
                await asyncio.wait({self._spawning}, timeout=self.rt.startup_timeout_s)
                await asyncio.sleep(0)  # the keeper, woken first, makes it `_standby`
        spare, self._standby = self._standby, None
        adopted = spare is not None and spare.proc.returncode is None
        if spare is not None and adopted:
            # a warm spare becomes this worker: no interpreter start-up, no imports
            spare.owner = w
            w.proc = spare.proc
            assert w.proc.stdin is not None
            w.proc.stdin.write(msgspec.json.encode(Launch(w.argv[3:])) + b"\n")
            await w.proc.stdin.drain()
            self._standby_taken.set()
        else:
            w.proc = await asyncio.create_subprocess_exec(
                *w.argv,
                env=w.env,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
                preexec_fn=die_with_parent,
                start_new_session=True,
            )
            asyncio.create_task(self._forward_stderr(_Owner(w), w.proc))
        try:
            info = await asyncio.wait_for(self._ready_line(w.proc), self.rt.startup_timeout_s)
        except (TimeoutError, EOFError, msgspec.ValidationError) as exc:
            code = await self._kill(w.proc)
            tail = "\n".join(f"    {line}" for line in list(w.stderr_tail)[-15:])
            why = "did not become ready in time" if isinstance(exc, TimeoutError) else f"exited ({code})"
            if isinstance(exc, msgspec.ValidationError):
                why = f"sent a malformed ready line ({exc})"
            w.state = "failed"
            raise StartupError(f"worker {w.name} {why}; its last output:\n{tail}") from None
        w.health, w.url, w.kv_address = info, info.url, info.kv_address
        w.info = {**msgspec.to_builtins(info), "from_standby": adopted}
        w.ready_at = time.monotonic()
        w.startup_s = w.ready_at - w.started_at
        w.state = "ready"
        log.info("worker %s ready at %s (pid %s) in %.1fs", w.name, w.url, w.pid, w.startup_s)
        self.on_event("ready", w)

    @staticmethod
    async def _ready_line(proc: asyncio.subprocess.Process) -> ReadyLine:
        """The worker's ready line (other lines on its stdout are skipped); a malformed one raises
        msgspec.ValidationError."""
        assert proc.stdout is not None
        while True:
            raw = await proc.stdout.readline()
            if not raw:
                raise EOFError
            try:
                event = _EVENT.decode(raw).event
            except msgspec.DecodeError:
                continue  # not a line of ours
            if event == "ready":
                return msgspec.json.decode(raw, type=ReadyLine)

    async def _forward_stderr(self, owner: _Owner | Standby, proc: asyncio.subprocess.Process) -> None:
        assert proc.stderr is not None
        while raw := await proc.stderr.readline():
            line = raw.decode(errors="replace").rstrip()
            w = owner.owner
            if w is not None:
                w.stderr_tail.append(line)
            if line:
                print(worker_line(w.name if w else "standby", line), file=sys.stderr, flush=True)

    async def _keep_standby(self) -> None:
        """Keep one warm spare (standby.py): anew once a restart took it; when it dies unused, its
        replacement starts at once, then after the restart backoff (doubled) for each death in a row."""
        delay, backoff = 0.0, self.rt.restart_backoff_s
        while not self._stopping:
            self._standby_taken.clear()
            self._spawning = asyncio.ensure_future(spawn_standby(self.env, self._forward_stderr))
            spare = await self._spawning
            if self._stopping and spare is not None:
                await kill(spare.proc)
            if spare is None or self._stopping:
                return
            self._standby = spare
            born = time.monotonic()
            code = await taken_or_dead(spare, self._standby_taken)
            if code is None:  # became a worker
                continue
            if self._standby is spare:
                self._standby = None
            if self._stopping:
                return
            if time.monotonic() - born > STABLE_S:
                delay, backoff = 0.0, self.rt.restart_backoff_s
            log.warning("the standby worker process (pid %s) exited with %s; replacing it in %.1fs",
                        spare.proc.pid, code, delay)  # fmt: skip
            sweep_stale(CORE_SOCKETS)  # its engine core's socket folder, once the core is gone
            await asyncio.sleep(delay)
            delay, backoff = backoff, min(backoff * 2, self.rt.restart_backoff_max_s)

    # ---- watch and restart ----------------------------------------------------------------------

    async def _watch(self, w: WorkerProcess) -> None:
        backoff = self.rt.restart_backoff_s
        while not self._stopping:
            assert w.proc is not None
            health = asyncio.create_task(self._health_loop(w))
            try:
                code = await w.proc.wait()
            finally:
                health.cancel()
            if self._stopping or w.state in ("retiring", "stopped"):  # removed on purpose (local_scale.py)
                return
            w.last_exit = code
            up = time.monotonic() - w.ready_at
            if up > STABLE_S:
                backoff = self.rt.restart_backoff_s
            w.state = "restarting"
            self.on_event("died", w)
            if w.restarts >= self.rt.max_restarts:
                w.state = "failed"
                log.error("worker %s exited (%s) and has used its %d restarts; it stays down", w.name, code,
                          self.rt.max_restarts)  # fmt: skip
                return
            log.error("worker %s (pid %s) exited with %s after %.1fs; restarting in %.1fs", w.name, w.pid,
                      code, up, backoff)  # fmt: skip
            await asyncio.sleep(backoff)
            backoff = min(backoff * 2, self.rt.restart_backoff_max_s)
            w.restarts += 1
            try:
                await self._spawn(w, restart=True)
            except StartupError as exc:
                log.error("%s", exc)
                w.state = "restarting"
            self.on_event("restarted", w)

    async def _health_loop(self, w: WorkerProcess) -> None:
        misses = 0
        while True:
            await asyncio.sleep(self.rt.health_interval_s)
            if w.state != "ready" or w.url is None:
                continue
            try:
                r = await self._http.get(f"{w.url}/health", timeout=max(1.0, self.rt.health_interval_s * 2))
                r.raise_for_status()
                w.health = msgspec.json.decode(r.content, type=Health)
                w.info.update(msgspec.to_builtins(w.health))
                misses = 0
            except (httpx.HTTPError, ValueError) as exc:
                misses += 1
                log.warning(
                    "worker %s missed a health check (%d/%d): %s",
                    w.name,
                    misses,
                    self.rt.health_failures,
                    exc,
                )
                if misses >= self.rt.health_failures and w.proc is not None:
                    log.error("worker %s is unresponsive; killing it for a restart", w.name)
                    w.state = "restarting"
                    await self._kill(w.proc)
                    return

    # ---- stop -----------------------------------------------------------------------------------

    async def stop(self, grace_s: float = 10.0) -> None:
        self._stopping = True
        for task in [*self._tasks, *([self._keeper] if self._keeper else [])]:
            task.cancel()
        procs = [w.proc for w in self.workers if w.proc is not None and w.proc.returncode is None]
        if self._standby is not None:
            procs.append(self._standby.proc)
        await asyncio.gather(*(self._kill(p, grace_s) for p in procs), return_exceptions=True)
        for w in self.workers:
            w.state = "stopped"
        if self._mps_daemon is not None:
            await asyncio.to_thread(self._mps_daemon.stop)
        if self.zygote is not None:
            await asyncio.to_thread(self.zygote.stop)
        if self.core_share is not None:
            shutil.rmtree(os.path.dirname(self.core_share), ignore_errors=True)
        sweep_stale(CORE_SOCKETS)  # the socket folders of engine cores SIGKILLed with their front end
        await self._http.aclose()

    _kill = staticmethod(kill)

    def describe(self) -> list[dict]:
        return [w.describe() for w in self.workers]

    def mps_state(self) -> dict | None:
        """CUDA MPS as start() left it: None when no two workers share a GPU."""
        if self.mps is None or not self.mps.devices:
            return None
        return {"on": self.mps.start, "devices": self.mps.devices, "why": self.mps.why}


__all__ = ["LocalRuntime", "StartupError", "WorkerProcess", "worker_argv"]
