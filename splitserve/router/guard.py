"""What the router serves besides the API: kept behind the API key, or cheap.

`DocsGuard`: with API keys set, FastAPI's /docs, /redoc and /openapi.json want a key too (they
describe the deployment). `MetricsSnapshot`: /metrics is open to a scraper (as vLLM's), so it is served
from a snapshot taken on its own clock: a flood of scrapes does not take the router's loop from the
requests (bench/metrics_flood.py measures it).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol
from urllib.parse import parse_qs

from starlette.requests import Request
from starlette.responses import JSONResponse

from splitserve.router.openai_protocol import APIError

log = logging.getLogger(__name__)
METRICS_TYPE = "text/plain; version=0.0.4; charset=utf-8"
DOC_PATHS = ("/docs", "/docs/oauth2-redirect", "/redoc", "/openapi.json")


class Authenticator(Protocol):
    """What DocsGuard needs of the server (api.OpenAIServer)."""

    def check_auth(self, request: Request) -> None: ...


class DocsGuard:
    def __init__(self, app: Any, get: Callable[[], Authenticator]) -> None:
        self.app, self.get = app, get

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] in DOC_PATHS:
            try:
                self.get().check_auth(Request(scope))
            except APIError as exc:
                answer = JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)
                await answer(scope, receive, send)
                return
        await self.app(scope, receive, send)


class MetricsEndpoint:
    """GET /metrics answered here, before the other middlewares and the routing: the snapshot's bytes,
    with no key asked (as vLLM's). With `server.metrics_auth` on, the request goes on to the route,
    which asks for a key first. `?fresh=1`: the next snapshot (MetricsSnapshot.get)."""

    def __init__(self, app: Any, get: Callable[[], Any]) -> None:
        self.app, self.get = app, get

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["path"] != "/metrics" or scope["method"] != "GET":
            await self.app(scope, receive, send)
            return
        server = self.get()
        if server.manifest.server.metrics_auth and server.keys:
            await self.app(scope, receive, send)
            return
        fresh = parse_qs(scope.get("query_string", b"").decode("latin-1")).get("fresh", [""])[0] in (
            "1",
            "true",
        )
        body = await server.metrics_cache.get(fresh=fresh)
        headers = [(b"content-type", METRICS_TYPE.encode()), (b"content-length", str(len(body)).encode())]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        await send({"type": "http.response.body", "body": body})


class MetricsSnapshot:
    """/metrics served from a snapshot taken on its own clock: a background task renders the body every
    `interval_s` (reading every worker's /stats), and a scrape only copies the last body, so a flood of
    scrapes costs the router no rendering and the workers no /stats calls. The clock starts with the
    first scrape (which waits for that first render) and stops after `idle_s` without one.
    `get(fresh=True)` waits for the next snapshot instead (at most `interval_s`): for a reader that
    needs what happened just before it asked; it never renders one itself."""

    def __init__(self, render: Callable[[], Awaitable[bytes]], interval_s: float = 1.0,
                 idle_s: float = 60.0) -> None:  # fmt: skip
        self.render, self.interval_s, self.idle_s = render, interval_s, idle_s
        self._body: bytes | None = None
        self._task: asyncio.Task | None = None
        self._taken = asyncio.Event()  # set when the next snapshot to start has been taken
        self._asked = time.monotonic()

    async def get(self, fresh: bool = False) -> bytes:
        self._asked = time.monotonic()
        if self._task is None or self._task.done():
            self._body = None
            self._task = asyncio.create_task(self._clock())
        if fresh or self._body is None:
            await self._taken.wait()
        assert self._body is not None
        return self._body

    async def _clock(self) -> None:
        while True:
            # readers that asked before this render starts wait for it; those who ask during it, for
            # the next (an idle check here, with no await before the swap, leaves none waiting)
            if self._body is not None and time.monotonic() - self._asked > self.idle_s:
                return
            taken, self._taken = self._taken, asyncio.Event()
            try:
                self._body = await self.render()
            except Exception:  # noqa: BLE001 - the last body stays; the next tick tries again
                log.warning("metrics snapshot failed", exc_info=True)
                if self._body is None:
                    self._body = b""
            taken.set()
            await asyncio.sleep(self.interval_s)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None


__all__ = ["DOC_PATHS", "METRICS_TYPE", "DocsGuard", "MetricsEndpoint", "MetricsSnapshot"]
