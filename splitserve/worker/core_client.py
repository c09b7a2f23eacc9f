"""The front end's side of the engine-core channel: start the core process, send it commands, route
its per-step batches to the requests waiting on them, and notice when it dies.

    client = CoreClient.spawn()          # the core starts importing torch at once (a warm spare)
    info = client.start(config)          # hand it the spec; blocks until it is ready (or died)
    client.attach(loop)                  # from the event loop that serves HTTP
    stream = client.add(rid, ids, params)        # or client.import_kv(...)
    result = await client.call(op)               # an operation of wire/ops.py
    await stream.accepted                        # the core's refusal is raised here (CoreError)
    deltas = await stream.take()                 # every delta since the last take, at least one

Threads: a reader blocks on the batch socket and hands each decoded batch to the event loop (one
hop per engine step, not per token); a watcher waits on the core's pid. Commands are sent from the
event loop's thread only. The sockets are ipc:// in a private 0700 directory, removed on close.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq

from splitserve.sampling.params import SamplingParams
from splitserve.tempdirs import CORE_SOCKETS, owned_tempdir, process_state
from splitserve.wire import core as wire
from splitserve.wire import ops
from splitserve.wire.http import Timings
from splitserve.wire.stats import Health
from splitserve.worker.core_fork import ForkedCore, fork_core

log = logging.getLogger(__name__)


_PREFIX = CORE_SOCKETS


class CoreDead(RuntimeError):
    """The engine-core process is gone."""


def _dead_info(why: str) -> wire.ErrorInfo:
    return wire.ErrorInfo(503, "engine_dead", why)


class RequestStream:
    """One request's deltas, as the reader hands them over."""

    __slots__ = ("_loop", "_waiter", "accepted", "error", "items", "timings")

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._waiter: asyncio.Future | None = None
        self.accepted: asyncio.Future = loop.create_future()
        self.items: list[wire.Delta] = []
        self.error: BaseException | None = None
        self.timings: Timings | None = None  # an import's, from its Accepted

    def push(self, delta: wire.Delta) -> None:
        self.items.append(delta)
        self._wake()

    def accept(self, timings: Timings | None) -> None:
        self.timings = timings
        if not self.accepted.done():
            self.accepted.set_result(timings)

    def fail(self, exc: BaseException) -> None:
        if not self.accepted.done():
            self.accepted.set_exception(exc)
            self.accepted.exception()  # retrieved: no "never retrieved" warning if nobody awaits
        self.error = exc
        self._wake()

    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    async def take(self) -> list[wire.Delta]:
        while not self.items:
            if self.error is not None:
                raise self.error
            self._waiter = self._loop.create_future()
            await self._waiter
        items, self.items = self.items, []
        return items


class CoreClient:
    def __init__(self, proc: subprocess.Popen | ForkedCore, ctx: zmq.Context, sockdir: str) -> None:
        self.proc, self.ctx, self.sockdir = proc, ctx, sockdir
        self.commands = ctx.socket(zmq.PUSH)
        self.commands.setsockopt(zmq.SNDHWM, 0)
        self.commands.setsockopt(zmq.LINGER, 0)
        self.commands.bind(f"ipc://{sockdir}/commands")
        self.batches = ctx.socket(zmq.PULL)
        self.batches.setsockopt(zmq.RCVHWM, 0)
        self.batches.setsockopt(zmq.LINGER, 0)
        self.batches.bind(f"ipc://{sockdir}/batches")
        self.streams: dict[str, RequestStream] = {}
        self.calls: dict[int, asyncio.Future] = {}
        self._ids = itertools.count()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.dead: str | None = None  # why the core is gone
        self.on_death: Callable[[str], None] | None = None
        self.on_cache_events: Callable[[wire.CacheEvents], None] | None = None  # the prefix cache's changes
        self._closing = False
        self._reading: threading.Thread | None = None

    def stopped(self) -> bool:
        """The core is alive but stopped (SIGSTOP, a cgroup freezer): it answers nothing, yet its front
        end would look healthy. /proc/PID/stat's state "T"."""
        return process_state(self.proc.pid) == "T"

    @classmethod
    def spawn(cls) -> CoreClient:
        # 0700: only this user can connect; named by our pid, so that a later start can sweep it up
        sockdir = owned_tempdir(_PREFIX)
        # NOTE: the core's stdout is our stderr: a worker's stdout carries its ready line alone, and
        # libraries in the core (NIXL's logger, UCX) print to stdout
        # from the fork server where the local runtime started one (core_fork.py): no imports
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        proc: subprocess.Popen | ForkedCore | None = fork_core(env)
        if proc is None:
            proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.core.loop"], stdin=subprocess.PIPE, text=True,
                stdout=sys.stderr.fileno(), env=env,
            )  # fmt: skip
        return cls(proc, zmq.Context(io_threads=1), sockdir)

    # ---- start -----------------------------------------------------------------------------------

    def begin(self, config: Any, log_level: str = "WARNING") -> None:
        """Hand the core its spec (a WorkerConfig); it starts loading at once."""
        spec = wire.CoreSpec(
            config=config.to_json(), threads=config.threads, log_level=log_level,
            commands=f"ipc://{self.sockdir}/commands", batches=f"ipc://{self.sockdir}/batches",
        )  # fmt: skip

        assert self.proc.stdin is not None
        try:
            self.proc.stdin.write(msgspec.json.encode(spec).decode() + "\n")
            self.proc.stdin.flush()
            if not getattr(self.proc, "keeps_stdin", False):
                self.proc.stdin.close()
        except BrokenPipeError:
            pass

    def wait_ready(self, timeout_s: float = 3600.0) -> Health:
        """Wait for the core's Ready; -> the worker's static health info. Raises CoreDead with the
        core's exit status if it died first (its own error is on the stderr we share)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.batches.poll(200):
                batch = wire.batch_decoder.decode(self.batches.recv())
                for ev in batch.events:
                    if isinstance(ev, wire.Ready):
                        return ev.info
            code = self.proc.poll()
            if code is not None:
                self.close()
                raise CoreDead(f"the engine core exited with status {code} before it was ready")
        self.close()
        raise CoreDead(f"the engine core was not ready within {timeout_s:g}s")

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self._reading = threading.Thread(target=self._read, name="core-reader", daemon=True)
        self._reading.start()
        threading.Thread(target=self._watch, name="core-watcher", daemon=True).start()

    # ---- requests --------------------------------------------------------------------------------

    def _send(self, cmd: wire.Command) -> None:
        if self.dead is not None:
            raise CoreDead(self.dead)
        self.commands.send(wire.command_encoder.encode(cmd), copy=False)

    def _open(self, rid: str) -> RequestStream:
        if self.dead is not None:
            raise CoreDead(self.dead)
        if rid in self.streams:
            raise ValueError(f"request id {rid!r} is already in flight on this worker")
        assert self.loop is not None, "attach() first"
        stream = self.streams[rid] = RequestStream(self.loop)
        return stream

    def add(
        self, rid: str, prompt_ids: list[int], params: SamplingParams, export: bool = False
    ) -> RequestStream:
        stream = self._open(rid)
        self._send(wire.Add(rid, prompt_ids, params, export))
        return stream

    def import_kv(self, cmd: wire.Import) -> RequestStream:
        stream = self._open(cmd.request_id)
        self._send(cmd)
        return stream

    def abort(self, rid: str) -> None:
        """Stop a request in the core; its stream, if still read, ends with finish_reason "abort"."""
        if self.dead is None:
            self._send(wire.Abort(rid))

    def cancel(self, rid: str) -> None:
        """The stream's reader went away: forget the stream and stop the request (idempotent)."""
        self.streams.pop(rid, None)
        self.abort(rid)

    def forget(self, rid: str) -> None:
        self.streams.pop(rid, None)

    def call_id(self) -> int:
        """A fresh id for an operation (wire/ops.py) to be sent with `call`."""
        return next(self._ids)

    async def call(self, op: ops.Op, wait_s: float = 60.0) -> ops.OpResult:
        """Send `op` (made with `call_id()`); -> its result, or its error raised as CoreError."""
        if self.dead is not None:
            raise CoreDead(self.dead)
        assert self.loop is not None, "attach() first"
        call_id = op.call_id
        fut = self.calls[call_id] = self.loop.create_future()
        self._send(op)
        try:
            return await asyncio.wait_for(fut, wait_s)
        finally:
            self.calls.pop(call_id, None)

    # ---- the reader (its own thread) and the dispatch (the loop's) -------------------------------

    def _read(self) -> None:
        loop = self.loop
        assert loop is not None
        while True:
            try:
                raw = self.batches.recv(copy=False)
            except zmq.ZMQError:  # ETERM: close() terminates the context; this thread owns the socket
                self.batches.close(0)
                return
            batch = wire.batch_decoder.decode(raw.buffer)
            try:
                loop.call_soon_threadsafe(self._dispatch, batch)
            except RuntimeError:
                return  # the loop is closed

    def _dispatch(self, batch: wire.Batch) -> None:
        streams = self.streams
        for ev in batch.events:
            if isinstance(ev, wire.Accepted):
                s = streams.get(ev.request_id)
                if s is not None:
                    s.accept(ev.timings)
            elif isinstance(ev, wire.Refused):
                s = streams.pop(ev.request_id, None)
                if s is not None:
                    s.fail(wire.CoreError(ev.error))
            elif isinstance(ev, wire.Reply):
                fut = self.calls.get(ev.call_id)
                if fut is not None and not fut.done():
                    if ev.error is not None:
                        fut.set_exception(wire.CoreError(ev.error))
                    else:
                        fut.set_result(ev.result)
            elif isinstance(ev, wire.CacheEvents) and self.on_cache_events is not None:
                self.on_cache_events(ev)
        for d in batch.deltas:
            s = streams.get(d.request_id)
            if s is not None:
                s.push(d)
                if d.finished:
                    del streams[d.request_id]

    def _watch(self) -> None:
        code = self.proc.wait()
        if self._closing:
            return
        why = f"the engine core (pid {self.proc.pid}) exited with status {code}"
        log.error("%s; failing %d requests in flight", why, len(self.streams))
        loop = self.loop
        if loop is not None:
            try:
                loop.call_soon_threadsafe(self._died, why)
            except RuntimeError:
                pass

    def _died(self, why: str) -> None:
        self.dead = why
        err = wire.CoreError(_dead_info(why))
        for s in self.streams.values():
            s.fail(err)
        self.streams.clear()
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(err)
        if self.on_death is not None:
            self.on_death(why)

    def fail_all(self, info: wire.ErrorInfo) -> int:
        """Fail every request and operation in flight with `info` (their callers answer its status),
        and take no more: the core is about to be replaced. -> how many requests."""
        self.dead = info.message
        err = wire.CoreError(info)
        failed = len(self.streams)
        for s in self.streams.values():
            s.fail(err)
        self.streams.clear()
        for fut in self.calls.values():
            if not fut.done():
                fut.set_exception(err)
        return failed

    # ---- stop ------------------------------------------------------------------------------------

    def close(self, timeout_s: float = 10.0) -> None:
        """Ask the core to stop, wait for it (then kill it), close the sockets, remove their folder."""
        self._closing = True
        if self.proc.poll() is None:
            try:
                self.commands.send(wire.command_encoder.encode(wire.Shutdown()), zmq.NOBLOCK)
            except zmq.ZMQError:
                pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.commands.close(0)
        if self._reading is None:
            self.batches.close(0)
        self.ctx.term()  # a blocked reader gets ETERM and closes its socket, then this returns
        shutil.rmtree(self.sockdir, ignore_errors=True)
