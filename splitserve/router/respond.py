"""Answering one API request: `respond` takes a slot in the bounded queue (admission.py), starts a `Run`
(run.py) and waits for its first piece of output, so that a request that fails before producing
anything gets a real status; then it answers with one JSON body, or an SSE stream in a `CleanupStream`
that gives the slot back however the stream ends. A client that goes away cancels the run's choices
(`unless_disconnected`), which aborts them on the workers."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TYPE_CHECKING, Any

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.router.openai_protocol import APIError
from splitserve.router.run import Run
from splitserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from splitserve.router.parsers import ChatOutput
    from splitserve.router.server import OpenAIServer
    from splitserve.router.thinking import ThinkingTokens


class CleanupStream(StreamingResponse):
    """A streaming response that runs `cleanup` however it ends: finished, failed or the client gone
    (a generator never started, or left suspended at a yield, would otherwise run no `finally`)."""

    def __init__(
        self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._cleanup = cleanup

    @property
    def cleanup(self) -> Callable[[], Awaitable[None]]:
        return self._cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


async def unless_disconnected(request: Request, work: Awaitable[dict]) -> dict:
    """Run `work`; if the client disconnects first, cancel it (its choices abort on the workers)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise APIError(499, "client closed the request", code="client_closed")
    return task.result()


async def respond(
    server: OpenAIServer,
    kind: str,
    req: Any,
    prompts: list[tuple[list[int], str]],
    params: SamplingParams,
    start: float,
    request: Request,
    output: Callable[[], ChatOutput] | None = None,
    thinking: Callable[[], ThinkingTokens] | None = None,
) -> Response:
    rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
    name = server.info.served_name
    waited = await server.admission.acquire()  # errors are counted by status in access_log.py
    server.metrics.router_queue.labels(name).observe(waited)
    run = request.state.splitserve_run = Run(server, kind, req, prompts, params, rid, start)
    run.output = output
    run.count_thinking(thinking)
    server.runs.add(run)
    released = False

    async def cleanup() -> None:  # idempotent: cancel what still runs, give the slot back
        nonlocal released
        server.runs.discard(run)
        await run.cancel()
        if not released:
            released = True
            server.admission.release()

    handed_over = False
    try:
        run.launch()
        first = await run.first()
        if req.stream:
            handed_over = True
            return CleanupStream(
                run.sse(first), cleanup, media_type="text/event-stream", headers=run.headers()
            )
        body = await unless_disconnected(request, run.collect(first))
        return JSONResponse(body, headers=run.headers())
    except APIError as exc:
        server.kv_failed(exc)
        raise
    finally:
        if not handed_over:
            await cleanup()
