"""An exception that escapes a route is answered here, as OpenAI's 500 body, and goes no further.

Starlette's outermost ServerErrorMiddleware answers such an exception too, but then re-raises it, and
uvicorn closes the keep-alive connection: the client's next request on it fails. Inside
the user middlewares this one answers once, logs once, and keeps the connection. A response already
under way (a stream) cannot be turned into a 500; it is logged and ended instead.
"""

from __future__ import annotations

import json
import logging
from typing import Any

from splitserve.router.openai_protocol import APIError

log = logging.getLogger("splitserve.router.server")


class ContainErrors:
    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def watch(message: dict) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, receive, watch)
        except Exception as exc:  # noqa: BLE001 - the point: answered here, the connection kept
            log.error("%s %s failed", scope.get("method"), scope.get("path"), exc_info=exc)
            if started:
                await send({"type": "http.response.body", "body": b"", "more_body": False})
                return
            error = APIError(500, f"internal error ({type(exc).__name__})", type="server_error")
            body = json.dumps(error.body()).encode()
            await send({"type": "http.response.start", "status": 500,
                        "headers": [(b"content-type", b"application/json"),
                                    (b"content-length", str(len(body)).encode())]})  # fmt: skip
            await send({"type": "http.response.body", "body": body})


__all__ = ["ContainErrors"]
