"""HTTP for the worker service: FastAPI routes over `Worker`, errors as JSON, NDJSON streams, uvicorn.

Errors are `{"error": {"type", "message", ...}}` with a status that says what to do about them (the
engine core picks it, core/errors.py's `error_info`):
400 a bad request or an endpoint this role does not serve; 403 the KV peer could not prove the shared
secret; 409 the KV peer's layout differs (the list of differences is in `mismatches`); 503 no room
in time or the engine is gone; 409 `stale_role` a call stamped with a role or role epoch this worker
no longer has, or made while it changes role (wire/role.py); 504 the KV fetch ran past its deadline;
502 any other transfer failure.
A /decode or /generate stream answers its status before the first line: a failed KV import
(policy "fail") is an HTTP error, never a half-written stream.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import os
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any, TypeVar

import msgspec
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from splitserve.config.worker import WorkerConfig
from splitserve.web.edge_guard import ReadLimits, guarded_protocol
from splitserve.web.listen import KEEP_ALIVE_S, listen
from splitserve.wire.auth import worker_token
from splitserve.wire.core import CoreError
from splitserve.wire.http import (
    LINE_ENCODER,
    AbortRequest,
    DecodeRequest,
    GenerateRequest,
    PeerRequest,
    PrefillRequest,
    ProbeExportRequest,
    ProbeRequest,
    ReleaseRequest,
    StreamLine,
)
from splitserve.wire.ops import FaultKnobs, Ok
from splitserve.wire.role import ROLE_CHANGED, RoleSwitch
from splitserve.worker.core_client import CoreDead
from splitserve.worker.metrics import render_worker_metrics
from splitserve.worker.service import StaleRole, Worker

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"
B = TypeVar("B")


async def _body(request: Request, kind: type[B]) -> B:
    """The request's JSON body as `kind`; a malformed one raises msgspec's error (a ValueError: 400)."""
    return msgspec.json.decode(await request.body(), type=kind)


def _json(body: object, status: int = 200) -> Response:
    return Response(LINE_ENCODER.encode(body), status_code=status, media_type="application/json")


def _error(status: int, error_type: str, message: str, **extra: object) -> JSONResponse:
    return JSONResponse({"error": {"type": error_type, "message": message, **extra}}, status_code=status)


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(CoreError)
    async def core_error(_: Request, exc: CoreError) -> JSONResponse:
        info = exc.info
        extra = {} if info.kind is None else {"kind": info.kind, "mismatches": info.mismatches}
        if info.request_id is not None:
            extra["request_id"] = info.request_id
        return _error(info.status, info.type, info.message, **extra)

    @app.exception_handler(StaleRole)
    async def stale_role(_: Request, exc: StaleRole) -> JSONResponse:
        return _error(409, "stale_role", str(exc), param=None, code="stale_role", role=exc.role,
                      epoch=exc.epoch)  # fmt: skip

    @app.exception_handler(CoreDead)
    async def core_dead(_: Request, exc: CoreDead) -> JSONResponse:
        return _error(503, "engine_dead", str(exc))

    @app.exception_handler(ValueError)
    async def bad_request(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, "invalid_request", str(exc))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, "internal", f"{type(exc).__name__}: {exc}")


async def _ndjson(lines: AsyncIterator[StreamLine], stream: bool) -> StreamingResponse | Response:
    """Run the stream up to its first line before answering, so that errors get a status."""
    first = await anext(lines, None)
    if not stream:
        got = [first] if first is not None else []
        got += [line async for line in lines]
        if not got:
            return _error(500, "internal", "the engine produced no output")
        tokens = [t for line in got for t in line.token_ids]
        lps = None if got[-1].logprobs is None else [x for line in got for x in line.logprobs or []]
        body = msgspec.structs.replace(got[-1], offset=0, token_ids=tokens, logprobs=lps,
                                       text="".join(x.text for x in got), timings=got[0].timings)  # fmt: skip
        return Response(LINE_ENCODER.encode(body), media_type="application/json")

    async def body() -> AsyncIterator[bytes]:
        encode = LINE_ENCODER.encode
        sent = 0
        try:
            if first is not None:
                yield encode(first) + b"\n"
                sent += len(first.token_ids)
            async for line in lines:
                yield encode(line) + b"\n"
                sent += len(line.token_ids)
        except (CoreDead, CoreError) as exc:  # the core died (or failed it) mid-stream: one line, no
            # traceback; the stream ends without a finished line, which the router counts as a cut
            rid = first.request_id if first is not None else "-"
            if isinstance(exc, CoreError) and exc.info.type == ROLE_CHANGED:  # the router migrates it
                yield encode(StreamLine(rid, sent, [], "", True, ROLE_CHANGED)) + b"\n"
                return
            log.warning("stream of %s cut: %s: %s", rid, type(exc).__name__, exc)
        finally:
            with contextlib.suppress(Exception):
                await lines.aclose()  # type: ignore[attr-defined]  # aborts an unfinished request

    return StreamingResponse(body(), media_type=NDJSON)


_OPEN = ("/health",)  # no token wanted (/metrics tells load and timings: a scraper sends the token)
_UNAUTHORIZED = b'{"error":{"type":"unauthorized","message":"this worker wants the worker token"}}'


class _RequireToken:
    """Every endpoint but GET /health answers 401 without `Authorization: Bearer <token>` (/metrics,
    in vLLM's names, as /stats: a gateway that scrapes the workers sends the token). A plain ASGI
    middleware: starlette's BaseHTTPMiddleware would put a memory stream under every chunk."""

    def __init__(self, app: Any, token: str) -> None:
        self.app = app
        self.expected = f"Bearer {token}".encode()

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in _OPEN:
            got = next((v for k, v in scope["headers"] if k == b"authorization"), b"")
            if not hmac.compare_digest(got, self.expected):
                body = _UNAUTHORIZED
                await send({"type": "http.response.start", "status": 401,
                            "headers": [(b"content-type", b"application/json")]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
                return
        await self.app(scope, receive, send)


def _exit_soon(why: str) -> None:
    """The engine core died: requests in flight have failed; let their answers go out, then exit so
    that the runtime restarts this worker (its core cannot be replaced under the same KV address)."""
    print(f"splitserve worker: {why}; exiting", file=sys.stderr, flush=True)
    asyncio.get_running_loop().call_later(0.5, os._exit, 3)


def build_app(worker: Worker, on_ready: Callable[[], None] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        worker.attach(asyncio.get_running_loop())
        worker.client.on_death = _exit_soon
        if on_ready is not None:
            on_ready()
        yield
        await worker.close()

    app = FastAPI(title=f"splitserve {worker.config.role} worker", lifespan=lifespan)
    _install_errors(app)
    if worker.config.http_auth:
        app.add_middleware(_RequireToken, token=worker_token(worker.config.kv_secret or ""))

    # Bodies are wire/http.py's msgspec structs, decoded and encoded here (not by FastAPI's pydantic).
    @app.post("/prefill")
    async def prefill(request: Request) -> Response:
        return _json(await worker.prefill(await _body(request, PrefillRequest)))

    @app.post("/decode", response_model=None)
    async def decode(request: Request) -> StreamingResponse | Response:
        req = await _body(request, DecodeRequest)
        return await _ndjson(worker.decode(req), req.stream)

    @app.post("/generate", response_model=None)
    async def generate(request: Request) -> StreamingResponse | Response:
        req = await _body(request, GenerateRequest)
        return await _ndjson(worker.generate(req), req.stream)

    @app.post("/abort")
    async def abort(request: Request) -> Response:
        worker.abort((await _body(request, AbortRequest)).request_id)
        return _json(Ok())

    @app.get("/health")
    async def health() -> Response:
        body = worker.health()
        return _json(body, status=503 if body.status == "engine_stopped" else 200)

    @app.get("/stats")
    async def stats() -> Response:
        return _json(await worker.stats())

    @app.get("/metrics")
    async def metrics() -> Response:
        c = worker.config
        name = c.served_name or str(worker.info.model or "model").rstrip("/").rsplit("/", 1)[-1]
        body = render_worker_metrics(await worker.stats(), name, c.engine.block_size)
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.post("/kv/connect")
    async def connect(request: Request) -> Response:
        req = await _body(request, PeerRequest)
        return _json(await worker.check_peer(req.address, req.timeout_s, req.stamp))

    @app.post("/kv/release")
    async def release(request: Request) -> Response:
        req = await _body(request, ReleaseRequest)
        return _json(await worker.release(req.kv_export, req.stamp))

    @app.post("/kv/probe/export")
    async def probe_export(request: Request) -> Response:
        req = await _body(request, ProbeExportRequest)
        return _json(await worker.probe_export(req.num_blocks, req.stamp))

    @app.post("/kv/probe")
    async def probe(request: Request) -> Response:
        req = await _body(request, ProbeRequest)
        return _json(await worker.probe(req.kv_export, req.timeout_s, req.stamp))

    @app.post("/role/prepare")
    async def prepare_role() -> Response:
        """The runtime's, as a role change's drain begins: start the next engine core's imports."""
        worker.prepare_role()
        return _json(Ok())

    @app.post("/role")
    async def role(request: Request) -> Response:
        """The runtime's: restart the engine core in another role (Worker.change_role)."""
        spec = (await _body(request, RoleSwitch)).spec
        config = WorkerConfig.from_json(spec, kv_secret=worker.config.kv_secret)
        return _json(await worker.change_role(config))

    @app.post("/debug/faults")
    async def faults(request: Request) -> Response:
        return _json(await worker.set_faults(await _body(request, FaultKnobs)))

    return app


def serve(worker: Worker, host: str, port: int, on_ready: Callable[[str], None]) -> None:
    """Bind (port 0: the OS picks), then serve until SIGINT / SIGTERM; `on_ready(url)` once listening."""
    sock, url = listen(host, port)
    app = build_app(worker, lambda: on_ready(url))
    # the router's client is fast; a slow or huge request on a worker's port is not ours (web/edge_guard.py)
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_S, http=guarded_protocol(ReadLimits()))  # fmt: skip
    uvicorn.Server(config).run(sockets=[sock])


__all__ = ["build_app", "serve"]
