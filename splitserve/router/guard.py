"""What the router serves besides the API, kept behind the API key and cheap.

`DocsGuard`: with API keys set, FastAPI's /docs, /redoc and /openapi.json want a key too (they
describe the deployment). `MetricsCache`: /metrics is rendered at most once per `ttl_s`, however many
scrapers ask at once, so a flood of scrapes does not take the router's loop from the requests.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from starlette.requests import Request
from starlette.responses import JSONResponse

from splitserve.router.openai_protocol import APIError

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


class MetricsCache:
    def __init__(self, render: Callable[[], Awaitable[bytes]], ttl_s: float = 0.25) -> None:
        self.render, self.ttl_s = render, ttl_s
        self._body, self._at = b"", -1e9
        self._lock = asyncio.Lock()

    async def get(self) -> bytes:
        if time.monotonic() - self._at < self.ttl_s:
            return self._body
        async with self._lock:  # one render for every scraper waiting meanwhile
            if time.monotonic() - self._at >= self.ttl_s:
                self._body, self._at = await self.render(), time.monotonic()
            return self._body


__all__ = ["DOC_PATHS", "DocsGuard", "MetricsCache"]
