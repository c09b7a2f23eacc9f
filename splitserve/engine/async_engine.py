"""AsyncLLM: the engine on its own thread, with a per-request async stream and cancellation.

Life of a request:
  1. `generate()` posts an `_Add` to the inbox and awaits its acceptance: validation errors
     (prompt too long, bad ids) are raised to the caller before anything is streamed.
  2. The engine thread drains the inbox between steps, runs `step()` while there is work, and pushes
     each `RequestOutput` onto the request's asyncio queue through its event loop.
  3. The stream ends after the finished output. If the consumer stops early (client went away,
     task cancelled), the generator's `finally` posts an abort, which frees the request's KV blocks.
  4. If a step raises, every in-flight request gets the error and is aborted; the engine keeps serving.

Other work that must run on the engine thread (a KV import's block reservation, stats) goes through
`run_in_engine(fn)`; `stream(request_id, submit)` streams a request that `submit` puts into the engine
by other means than `add_request` (e.g. a KV import through `KVConnector`).

torch releases the GIL inside its kernels, so the event loop stays responsive while a step runs.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.request import RequestOutput
from splitserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)
T = TypeVar("T")


class EngineDeadError(RuntimeError):
    pass


@dataclass
class _OutputSink:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue

    def put(self, item: RequestOutput | BaseException) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


@dataclass
class _Add:
    request_id: str
    submit: Callable[[], RequestOutput | None]  # puts the request into the engine; raises to refuse it
    stream: _OutputSink
    accepted: asyncio.Future


@dataclass
class _Call:
    fn: Callable[[], Any]
    loop: asyncio.AbstractEventLoop | None = None
    done: asyncio.Future | None = None  # None: fire and forget


@dataclass
class _Abort:
    request_id: str


class AsyncLLM:
    def __init__(self, engine: LLMEngine) -> None:
        self.engine = engine
        self._inbox: queue.SimpleQueue[_Add | _Abort | _Call | None] = queue.SimpleQueue()
        self._streams: dict[str, _OutputSink] = {}
        self._ids = itertools.count()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="splitserve-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig) -> AsyncLLM:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):  # noqa: ANN201
        return self.engine.tokenizer

    async def generate(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams,
        request_id: str | None = None,
        kv_transfer: str | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs (cumulative) until the request finishes; closing the stream aborts it.
        `kv_transfer="export"`: see `LLMEngine.add_request` (prefill role)."""
        rid = request_id if request_id is not None else f"async-{next(self._ids)}"

        def submit() -> None:
            self.engine.add_request(prompt, params, request_id=rid, kv_transfer=kv_transfer)

        async for out in self.stream(rid, submit):
            yield out

    async def stream(
        self, request_id: str, submit: Callable[[], RequestOutput | None]
    ) -> AsyncIterator[RequestOutput]:
        """Run `submit` on the engine thread (it adds request `request_id`; what it raises is raised
        here; an output it returns is streamed first), then stream the request's outputs."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        stream = _OutputSink(loop, asyncio.Queue())
        accepted = loop.create_future()
        self._inbox.put(_Add(request_id, submit, stream, accepted))
        finished = False
        try:
            await accepted  # raises the engine's validation error, if any
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            if not finished:
                self.abort(request_id)

    def abort(self, request_id: str) -> None:
        self._inbox.put(_Abort(request_id))

    async def run_in_engine(self, fn: Callable[[], T]) -> T:
        """Run `fn` on the engine thread between steps; -> its result (or its exception, raised here)."""
        if self._closed:
            raise EngineDeadError("the engine is shut down")
        loop = asyncio.get_running_loop()
        done = loop.create_future()
        self._inbox.put(_Call(fn, loop, done))
        return await done

    def call_soon_in_engine(self, fn: Callable[[], Any]) -> None:
        """Run `fn` on the engine thread between steps, from any thread; its result is dropped."""
        self._inbox.put(_Call(fn))

    async def shutdown(self) -> None:
        self._closed = True
        self._inbox.put(None)
        await asyncio.to_thread(self._thread.join, 30)

    # ---- engine thread --------------------------------------------------------------------------

    def _run(self) -> None:
        while True:
            idle = not self.engine.has_unfinished_requests()
            if not self._drain(block=idle):
                break
            if not self.engine.has_unfinished_requests():
                self.engine.free_released_kv()  # exports whose lease ended while idle
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # noqa: BLE001 - reported to every waiting client
                log.exception("engine step failed; failing in-flight requests")
                self._fail_all(exc)
                continue
            for out in outputs:
                stream = self._streams.get(out.request_id)
                if stream is not None:
                    stream.put(out)
                if out.finished:
                    self._streams.pop(out.request_id, None)
        self._fail_all(EngineDeadError("the engine is shut down"))

    def _drain(self, block: bool) -> bool:
        """Apply queued commands; False on shutdown."""
        try:
            cmd = self._inbox.get(timeout=1.0) if block else self._inbox.get_nowait()
        except queue.Empty:
            return True
        while True:
            if cmd is None:
                return False
            self._apply(cmd)
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return True

    def _apply(self, cmd: _Add | _Abort | _Call) -> None:
        if isinstance(cmd, _Abort):
            self.engine.abort(cmd.request_id)
            self._streams.pop(cmd.request_id, None)
            return
        if isinstance(cmd, _Call):
            self._call(cmd)
            return
        try:
            first = cmd.submit()
        except Exception as exc:  # noqa: BLE001 - handed to the caller
            _settle(cmd.stream.loop, cmd.accepted, exc)
            return
        if first is not None:
            cmd.stream.put(first)
        if first is None or not first.finished:
            self._streams[cmd.request_id] = cmd.stream
        _settle(cmd.stream.loop, cmd.accepted, None)

    def _call(self, cmd: _Call) -> None:
        try:
            result, exc = cmd.fn(), None
        except Exception as e:  # noqa: BLE001 - handed to the caller
            result, exc = None, e
            if cmd.done is None:
                log.exception("engine-thread call failed")
        if cmd.done is not None and cmd.loop is not None:
            _settle(cmd.loop, cmd.done, exc, result)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, stream in list(self._streams.items()):
            self.engine.abort(rid)
            stream.put(exc)
        self._streams.clear()


def _settle(
    loop: asyncio.AbstractEventLoop, fut: asyncio.Future, exc: BaseException | None, result: Any = True
) -> None:
    def done() -> None:
        if fut.done():
            return
        if exc is None:
            fut.set_result(result)
        else:
            fut.set_exception(exc)

    loop.call_soon_threadsafe(done)
