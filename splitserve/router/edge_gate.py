"""`EdgeGate`: the router's front gate (gate.py) as a plain ASGI middleware in front of everything, the
access log included: a refused request is answered from its headers (its body never read), counted in
`splitserve:request_errors`, and logged within the gate's log budget."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from typing import Any

from splitserve.router.access_log import record
from splitserve.router.gate import GATED, GATED_PREFIXES

log = logging.getLogger("splitserve.access")


class EdgeGate:
    def __init__(self, app: Any, get: Callable[[], Any]) -> None:
        """`get()`: the OpenAIServer (its `gate`, metrics and manifest); RuntimeError while it starts."""
        self.app, self.get = app, get

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        path = scope["path"] if scope["type"] == "http" else ""
        if path in GATED or path.startswith(GATED_PREFIXES):
            start = time.perf_counter()
            try:
                server = self.get()
            except RuntimeError:  # the Ray router is still starting: its routes answer
                server = None
            refusal = server.gate.check(scope) if server is not None else None
            if server is not None and refusal is not None:
                status, headers, body = refusal
                headers = [(b"content-type", b"application/json"), *headers,
                           (b"content-length", str(len(body)).encode())]  # fmt: skip
                await send({"type": "http.response.start", "status": status, "headers": headers})
                await send({"type": "http.response.body", "body": body})
                self._record(server, scope, status, time.perf_counter() - start)
                return
        await self.app(scope, receive, send)

    @staticmethod
    def _record(server: Any, scope: Any, status: int, seconds: float) -> None:
        gate = server.gate
        logged = gate.log_budget.take(0) == 0.0
        if logged and gate.unlogged:
            log.info("%d more refusals (401, 429) were counted but not logged", gate.unlogged)
            gate.unlogged = 0
        gate.unlogged += not logged
        record(server, scope, status, seconds, logged)


__all__ = ["EdgeGate"]
