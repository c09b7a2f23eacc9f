"""The router's HTTP app while its deployment starts: the port answers from the moment it is bound.

`splitserve serve` binds its port first and serves this gate on it at once; while the workers load,
every request gets an immediate 503 instead of waiting in the listen queue: `/health` says
`{"status": "starting"}`, and every other path answers an OpenAI-format error ("the deployment is
starting") with a `Retry-After` header, which the official clients honour when they retry. Once the
deployment is ready, `open(app)` hands every later request to the API's app.
"""

from __future__ import annotations

import json

from starlette.types import ASGIApp, Receive, Scope, Send

RETRY_AFTER_S = 1  # what a client is told to wait before it asks again
STARTING = "the deployment is starting (its workers are loading the model); retry in a moment"


class StartGate:
    """An ASGI app: 503 for every HTTP request until `open(app)`, then `app` for everything."""

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.app: ASGIApp | None = None

    def open(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if self.app is not None:
            await self.app(scope, receive, send)
            return
        if scope["type"] != "http":  # uvicorn's lifespan is off; websockets are not served
            return
        if scope.get("path") == "/health":
            body = {"status": "starting", "mode": self.mode}
        else:
            body = {"error": {"message": STARTING, "type": "service_unavailable", "param": None,
                              "code": "starting"}}  # fmt: skip
        payload = json.dumps(body).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(payload)).encode()),
            (b"retry-after", str(RETRY_AFTER_S).encode()),
        ]
        await send({"type": "http.response.start", "status": 503, "headers": headers})
        await send({"type": "http.response.body", "body": payload})


__all__ = ["RETRY_AFTER_S", "STARTING", "StartGate"]
