"""The engine-core process of a worker: owns the device, the engine and the KV transport, and runs a
tight loop; its front end (worker/main.py) holds HTTP, tokenization, detokenization and streams.

    python -m splitserve.core.loop     # started by the front end; reads its spec as one JSON line

The loop (`EngineCore.run`), one turn per engine step:
  1. drain the commands: the socket without blocking (up to 100 ms only when there is no work):
     `Add` queues a request (a refusal goes back as `Refused`), `Import` starts a KV import,
     `Abort` stops a request, an operation of wire/ops.py runs (ops.py) and its `Reply` follows;
     then the calls other threads queued for the engine thread;
  2. step: `engine.step()` (a KV import waits inside the engine, in WAITING_FOR_KV: each step reserves
     its room and takes the connector's messages; a finished fetch wakes the loop);
  3. send the batch: one `Batch` to the front end with every request's new token ids and the events
     of this turn: the imports that ended (`Accepted` with their timings, or `Refused` per their
     policy) before the tokens. Nothing here waits on HTTP, JSON or text.
Which cores a step runs on, what an idle worker lends, and decode pacing (a pause after a step, its
cores lent) are the policy's (policy.py).
If a step raises, each request in flight is stepped alone (engine/isolate.py): those whose own step
raises are refused with a 5xx, the others go on. The core dies with its front end (PR_SET_PDEATHSIG, or
the end of its stdin when the fork server, zygote.py, made it);
the front end notices the core's death (worker/main.py).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import queue
import signal
import sys
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import msgspec
import zmq

from splitserve.core.errors import error_info
from splitserve.core.ops import CoreOps
from splitserve.core.policy import CorePolicy
from splitserve.core.setup import open_engine, warm_imports
from splitserve.engine import kv_events
from splitserve.startup_clock import mark
from splitserve.wire import core as wire
from splitserve.wire.http import Timings
from splitserve.wire.kv_events import CacheLoad
from splitserve.wire.stats import Health

log = logging.getLogger(__name__)

DEFERRED_AFTER_S = 2.0  # after ready, the build's deferred work (oneDNN layouts) runs in a thread
IDLE_WAIT_MS = 100  # the longest the loop sleeps with nothing to do (an import waiting for room too)


class EngineCore:
    def __init__(self, config: Any, commands: zmq.Socket, batches: zmq.Socket) -> None:
        self.config = config
        self.commands, self.batches = commands, batches
        self.engine, self.connector, self.kv_address = open_engine(config)
        engine = self.engine
        self.ops = CoreOps(self)
        # the prefix cache's changes, sent with each batch for cache-aware routers (prefill, colocated)
        self.kv_events = None if config.role == "decode" else kv_events.attach(engine)
        self.sent: dict[str, int] = {}  # tokens sent per request in flight
        self.events: list[wire.Event] = []
        self.early: list[wire.Delta] = []  # deltas made outside a step, sent with this turn's batch
        self.busy_seconds = 0.0  # wall time of loop turns that had work (engine.step_seconds of it)
        self.call_pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="core-call")
        self._on_loop: queue.SimpleQueue[tuple[Any, Future]] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller = zmq.Poller()
        self.poller.register(commands, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.stopping = False
        self.policy = CorePolicy.open(config)  # core lending and decode pacing (policy.py)
        engine.wake_on_kv(self.wake)  # a lease ended or a fetch finished: take it at once

    # ---- what other threads use ------------------------------------------------------------------

    def wake(self, *_: object) -> None:
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: the loop is awake anyway

    def on_loop(self, fn: Any, timeout_s: float = 60.0) -> Any:
        """From a call thread: run `fn` on the engine's thread between steps; -> its result."""
        fut: Future = Future()
        self._on_loop.put((fn, fut))
        self.wake()
        return fut.result(timeout_s)

    def on_loop_nowait(self, fn: Any) -> None:
        """From any thread: run `fn` on the engine's thread between steps; its result is dropped."""
        self._on_loop.put((fn, Future()))
        self.wake()

    # ---- the loop --------------------------------------------------------------------------------

    def info(self) -> Health:
        return self.ops.health()

    def run(self) -> None:
        """Each turn: drain the commands, step, send the batch; then a decode pace if the policy says."""
        from splitserve.heap import freeze_heap

        freeze_heap("engine core")  # loaded and warmed up: what lives now lives for good
        self.batches.send(wire.batch_encoder.encode(wire.Batch(events=[wire.Ready(self.info())])))
        if self.engine.device.type == "cpu":  # what the build left for after ready (builder.py)
            threading.Timer(DEFERRED_AFTER_S, self._finish_deferred).start()
        while not self.stopping:
            t0, busy = self._take_commands()
            self._send(self._step())
            if busy:
                self.busy_seconds += time.perf_counter() - t0  # loop turns with work (stats: loop_s)
                if (end := self.policy.pace(t0)) is not None:
                    self._lend_until(end)
        self.close()

    def _finish_deferred(self) -> None:
        from splitserve.kernels.cpu.linear import pack_deferred

        if not self.stopping and (n := pack_deferred(self.engine.loaded.model)):
            log.info("CPU: oneDNN layouts of %d projections made after ready", n)

    def _take_commands(self) -> tuple[float, bool]:
        """Drain the commands (waiting for one only while there is no work), then run the calls queued
        for the engine thread. -> (when this turn's work started, whether it has any)."""
        engine = self.engine
        busy = engine.has_unfinished_requests() and not engine.waits_for_kv_only()
        t0 = time.perf_counter()
        if not busy:
            self.policy.idle()  # lent while this worker waits
        # idle: map the next KV pages a request will write (engine/kv_prefault.py), unless another
        # worker of this host is busy (it may be running on this worker's lent core); look again
        more = not busy and self.policy.may_work_idle() and engine.prefault.advance()
        self._drain(0 if busy or more else IDLE_WAIT_MS)
        if not busy:  # the turn's work starts when the idle wait ends
            t0, busy = time.perf_counter(), engine.has_unfinished_requests()
        self._run_on_loop()
        return t0, busy

    def _send(self, deltas: list[wire.Delta]) -> None:
        """One batch to the front end: these deltas and the events of this turn (if any of either)."""
        if self.kv_events is not None and (events := self.kv_events.drain()):
            pool = self.engine.pool
            load = CacheLoad(self.engine.num_unfinished_requests, pool.num_free, pool.num_blocks)
            self.events.append(wire.CacheEvents(events, load, self.kv_events.hybrid))
        if deltas or self.events:
            batch = wire.Batch(deltas, self.events)
            self.events = []
            self.batches.send(wire.batch_encoder.encode(batch), copy=False)

    def _lend_until(self, end: float) -> None:
        """Decode pacing: idle, with this worker's cores lent, until `end`, taking commands meanwhile."""
        while (left := end - time.perf_counter()) > 0 and not self.stopping:
            self._drain(max(1, int(left * 1e3)))
            # an import that came or a load that ended meanwhile: started, or timed, now (not at the
            # pace's end: that wait is no part of the transfer, and the fetch can run meanwhile); an
            # ended one is told now too (a refusal's 502 need not wait for the next step)
            self.engine.free_released_kv()
            self._imports_ended()
            self._send([])

    def _drain(self, timeout_ms: int) -> None:
        ready = dict(self.poller.poll(timeout_ms))
        if self._wake_r in ready:
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass
        if self.commands not in ready:
            return
        while True:
            try:
                raw = self.commands.recv(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            try:
                self._apply(wire.command_decoder.decode(raw.buffer))
            except Exception:  # noqa: BLE001 - one bad command must not stop the engine
                log.exception("engine core: a command failed")

    def _apply(self, cmd: wire.Command) -> None:
        if isinstance(cmd, wire.Add):
            self._add(cmd)
        elif isinstance(cmd, wire.Import):
            self._start_import(cmd)
        elif isinstance(cmd, wire.Abort):
            self._abort(cmd.request_id)
        elif isinstance(cmd, wire.Shutdown):
            self.stopping = True
        else:
            self.ops.call(cmd)

    def _run_on_loop(self) -> None:
        while True:
            try:
                fn, fut = self._on_loop.get_nowait()
            except queue.Empty:
                return
            try:
                fut.set_result(fn())
            except Exception as exc:  # noqa: BLE001 - handed to the waiting thread
                fut.set_exception(exc)

    # ---- requests --------------------------------------------------------------------------------

    def _add(self, cmd: wire.Add) -> None:
        try:
            self.engine.add_request(
                cmd.prompt_token_ids, cmd.params, cmd.request_id, kv_transfer="export" if cmd.export else None
            )
        except Exception as exc:  # noqa: BLE001 - the refusal goes back to the caller
            self.events.append(wire.Refused(cmd.request_id, error_info(exc)))
            return
        self.sent[cmd.request_id] = 0
        self.events.append(wire.Accepted(cmd.request_id))

    def _abort(self, rid: str) -> None:
        self.engine.abort(rid)  # an import: its outcome and its "abort" output come from a step
        if self.sent.pop(rid, None) is not None:  # tell its stream (the front end may still read it)
            self.early.append(wire.Delta(rid, [], True, "abort"))

    def _step(self) -> list[wire.Delta]:
        """One engine step (when a request is unfinished) -> the deltas to send: those made outside the
        step (aborts) first. With nothing unfinished: the KV messages that came meanwhile (exports whose
        lease ended while idle; outcomes a poll outside a step took, told now)."""
        deltas, self.early = self.early, []
        engine = self.engine
        if not engine.has_unfinished_requests():
            engine.free_released_kv()
            self._imports_ended()
            return deltas
        self.policy.before_step(working=not engine.waits_for_kv_only())
        try:
            outputs = engine.step()
        except Exception:  # noqa: BLE001 - pinned on the request(s) that cause it (isolate.py)
            log.exception("engine step failed; re-running its requests one by one")
            outputs = self._rerun_alone()
        self._imports_ended()  # before their first tokens: a stream starts with its Accepted
        for rid, exc in self.engine.take_grammar_failures():  # a 400 or 503, not an "abort" line
            if self.sent.pop(rid, None) is not None:
                self.events.append(wire.Refused(rid, error_info(exc)))
        return deltas + [d for out in outputs if (d := self._delta(out)) is not None]

    def _rerun_alone(self) -> list[Any]:
        """Step each request in flight alone: those whose own step raises fail with a 500, the others
        go on (their outputs returned) and are never told their request was at fault."""
        from splitserve.engine.isolate import rerun_alone

        outputs, culprits = rerun_alone(self.engine, list(self.sent))
        for rid, exc in culprits.items():
            self.sent.pop(rid, None)
            info = error_info(exc)  # a transport's own 5xx stays; anything else is our fault, never a 4xx
            if info.status < 500 or info.type == "internal":
                message = f"the engine failed while running this request ({type(exc).__name__}: {exc})"
                info = wire.ErrorInfo(500, "internal", message)
            self.events.append(wire.Refused(rid, info))
        return outputs

    def _delta(self, out: Any) -> wire.Delta | None:
        rid = out.request_id
        sent = self.sent.get(rid)
        if sent is None:
            return None  # aborted meanwhile
        comp = out.outputs[0]
        new = comp.token_ids[sent:]
        lps = None if comp.logprobs is None else list(comp.logprobs[sent:])
        timings = None
        if sent == 0:
            m = out.metrics
            arrival, sched, first = m.get("arrival_time"), m.get("scheduled_time"), m.get("first_token_time")
            if arrival is not None and sched is not None and first is not None:
                timings = Timings(
                    queue_s=max(0.0, sched - arrival),
                    prefill_s=max(0.0, first - sched),
                    cached_tokens=out.num_cached_tokens,
                )
        if out.finished:
            del self.sent[rid]
        else:
            self.sent[rid] = len(comp.token_ids)
        return wire.Delta(rid, new, out.finished, comp.finish_reason, comp.stop_reason, lps, out.kv_export,
                          timings, out.num_cached_tokens)  # fmt: skip

    # ---- KV imports (decode role) ---------------------------------------------------------------

    def _start_import(self, cmd: wire.Import) -> None:
        from splitserve.engine.kv_transfer_types import ImportSpec

        try:
            if self.connector is None or self.config.role != "decode":
                raise ValueError(f"this is a {self.config.role} worker: only a decode worker imports KV")
            export = cmd.kv_export
            spec = ImportSpec(
                handle=export.handle, prompt_token_ids=cmd.prompt_token_ids, first_token=cmd.first_token,
                params=cmd.params, request_id=cmd.request_id, generator_state=export.generator_state,
                first_logprob=cmd.first_logprob, policy=cmd.policy, timeout_s=cmd.timeout_s,
            )  # fmt: skip
            self.engine.import_request(spec)
        except Exception as exc:  # noqa: BLE001
            self.events.append(wire.Refused(cmd.request_id, error_info(exc)))

    def _imports_ended(self) -> None:
        """Each import that ended: `Accepted` (its stream starts; an already finished output follows
        from the step) or `Refused` per its policy."""
        for out in self.engine.take_import_outcomes():
            if out.error is not None:
                self.events.append(wire.Refused(out.request_id, error_info(out.error)))
                continue
            backend = self.connector.backend_name if self.connector is not None else None
            self.events.append(wire.Accepted(out.request_id, Timings(**out.info, kv_backend=backend)))
            self.sent[out.request_id] = 0

    def close(self) -> None:
        self.call_pool.shutdown(wait=False, cancel_futures=True)
        self.policy.close()
        if self.connector is not None:
            self.connector.close()


def die_with_parent() -> None:
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    if os.getppid() == 1:
        raise SystemExit(0)


def main() -> int:
    """Import what the engine needs first (so a spare core waits warm), then read the spec line."""
    die_with_parent()
    warm_imports()
    import torch

    if torch.cuda.is_available():
        torch.cuda.init()
    return serve_spec()


def _exit_at_eof() -> None:
    """The front end's end of stdin closed (it exited, or was killed): go too, as PR_SET_PDEATHSIG
    would have us go if the front end were our parent."""
    with contextlib.suppress(OSError, ValueError):
        sys.stdin.read()
    os.kill(os.getpid(), signal.SIGKILL)


def serve_spec(lifeline: bool = False) -> int:
    """Read the spec line, build the engine, run the loop. `lifeline`: the front end keeps our stdin
    open while it lives (a forked core: its parent is the fork server, not the front end)."""
    import torch

    mark("imports")  # start-up phases, in the worker's ready line (startup_clock.py)
    line = sys.stdin.readline()
    if not line:
        return 0  # the front end went away before handing us a spec
    if lifeline:
        threading.Thread(target=_exit_at_eof, name="core-lifeline", daemon=True).start()
    spec = msgspec.json.decode(line, type=wire.CoreSpec)
    from splitserve.logs import setup_logging

    setup_logging(spec.log_level)  # text or JSON, as the front end ($SPLITSERVE_LOG_FORMAT)
    from splitserve.config.worker import WorkerConfig
    from splitserve.core.pinning import pin

    pin(msgspec.json.decode(spec.config).get("cpus") or ())  # runtime.pin_cores: this worker's own CPUs
    torch.set_num_threads(max(1, spec.threads))
    from splitserve.model.errors import ModelLoadError
    from splitserve.transport import TransportError

    ctx = zmq.Context(io_threads=1)
    commands = ctx.socket(zmq.PULL)
    commands.connect(spec.commands)
    batches = ctx.socket(zmq.PUSH)
    batches.setsockopt(zmq.SNDHWM, 0)
    batches.connect(spec.batches)
    try:
        core = EngineCore(WorkerConfig.from_json(spec.config), commands, batches)
    except (ValueError, OSError, ModelLoadError, TransportError) as exc:
        print(f"splitserve worker: error: {exc}", file=sys.stderr, flush=True)
        return 2
    mark("engine")
    core.run()
    return 0


if __name__ == "__main__":
    sys.exit(main())
