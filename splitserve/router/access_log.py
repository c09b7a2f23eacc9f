"""The router's access log and error counts: one ASGI middleware around the OpenAI API's routes.

Every answer of a /v1/ route gets one INFO line on the `splitserve.access` logger (unless
`server.access_log` is false) and every error status one increment of `splitserve:request_errors`
(4xx included: a bad request, a missing key, an unknown model, the queue full):

    2026-12-02 01:20:00,101 INFO splitserve.access: cmpl-5c1d... POST /v1/completions 200 prompt_tokens=9
        completion_tokens=16 latency_ms=812.4 ttft_ms=120.3 client=127.0.0.1

The request id, the token counts and TTFT come from the request's `Run` (respond.py puts it in the ASGI
scope's state as `splitserve_run`); a request refused before it ran gets `-` and zeros. With
`--log-format json` the same fields are keys of the line's object. A streamed answer is logged when
its stream ends, so its tokens and latency are the whole request's.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.router.server import OpenAIServer

log = logging.getLogger("splitserve.access")


class AccessLog:
    """Plain ASGI (starlette's BaseHTTPMiddleware would put a memory stream under every chunk)."""

    def __init__(self, app: Any, get: Callable[[], OpenAIServer]) -> None:
        self.app = app
        self.get = get

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status = 500  # an exception that escapes the app becomes a 500 further out

        async def watch(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, watch)
        finally:
            self._record(scope, status, time.perf_counter() - start)

    def _record(self, scope: Any, status: int, seconds: float) -> None:
        try:
            server = self.get()
        except RuntimeError:  # the Ray router is still starting
            return
        record(server, scope, status, seconds)


def record(server: OpenAIServer, scope: Any, status: int, seconds: float, logged: bool = True) -> None:
    """Count an answer's error status, and log its line unless `logged` is False (the gate's refusals
    past its log budget are counted only)."""
    if status >= 400:
        server.metrics.errors.labels(server.info.served_name, str(status)).inc()
    if not logged or not server.manifest.server.access_log or not log.isEnabledFor(logging.INFO):
        return
    run = (scope.get("state") or {}).get("splitserve_run")
    usage = run.usage() if run is not None else {"prompt_tokens": 0, "completion_tokens": 0}
    ttft = getattr(run, "ttft", None)
    client = scope.get("client")
    rid = run.rid if run is not None else "-"
    if scope["path"] == "/v1/responses":  # the id the client sees there: resp_..., not chatcmpl-...
        rid = "resp_" + rid.removeprefix("chatcmpl-") if rid != "-" else rid
    fields = {
        "request_id": rid,
        "method": scope["method"],
        "route": scope["path"],
        "status": status,
        "prompt_tokens": usage["prompt_tokens"],
        "completion_tokens": usage["completion_tokens"],
        "latency_ms": round(seconds * 1e3, 1),
        "ttft_ms": None if ttft is None else round(ttft * 1e3, 1),
        "client": client[0] if client else None,
    }
    log.info(
        "%s %s %s %s prompt_tokens=%d completion_tokens=%d latency_ms=%.1f ttft_ms=%s client=%s",
        *{**fields, "ttft_ms": "-" if fields["ttft_ms"] is None else fields["ttft_ms"]}.values(),
        extra=fields,
    )


__all__ = ["AccessLog", "record"]
