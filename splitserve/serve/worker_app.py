"""HTTP for the worker service: FastAPI routes over `Worker`, errors as JSON, NDJSON streams, uvicorn.

Errors are `{"error": {"type", "message", ...}}` with a status that says what to do about them:
400 a bad request or an endpoint this role does not serve; 403 the KV peer could not prove the shared
secret; 409 the KV peer's layout differs (the list of differences is in `mismatches`); 503 no room
in time or the engine is gone; 504 the KV fetch ran past its deadline; 502 any other transfer failure.
A /decode or /generate stream answers its status before the first line: a failed KV import
(policy "fail") is an HTTP error, never a half-written stream.
"""

from __future__ import annotations

import contextlib
import hmac
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, StreamingResponse

from splitserve.engine.async_engine import EngineDeadError
from splitserve.engine.disagg import KVTransferFailed, NoRoom
from splitserve.kv import AuthError, PeerRefused, TransferTimeout, TransportError
from splitserve.serve.listen import KEEP_ALIVE_S, listen
from splitserve.serve.schemas import (
    AbortRequest,
    DecodeRequest,
    FaultsRequest,
    GenerateRequest,
    PeerRequest,
    PrefillRequest,
    PrefillResponse,
    ProbeExportRequest,
    ProbeRequest,
    ReleaseRequest,
    StreamLine,
)
from splitserve.serve.worker import Worker
from splitserve.serve.worker_auth import worker_token

log = logging.getLogger(__name__)

NDJSON = "application/x-ndjson"


def _error(status: int, error_type: str, message: str, **extra: object) -> JSONResponse:
    return JSONResponse({"error": {"type": error_type, "message": message, **extra}}, status_code=status)


def _transfer_status(exc: BaseException) -> int:
    for cls, status in ((AuthError, 403), (PeerRefused, 409), (TransferTimeout, 504), (NoRoom, 503)):
        if isinstance(exc, cls):
            return status
    return 502


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(KVTransferFailed)
    async def transfer_failed(_: Request, exc: KVTransferFailed) -> JSONResponse:
        mismatches = getattr(exc.cause, "mismatches", None)
        return _error(_transfer_status(exc.cause), "kv_transfer_failed", str(exc), kind=exc.kind,
                      request_id=exc.request_id, mismatches=mismatches)  # fmt: skip

    @app.exception_handler(TransportError)
    async def transport_error(_: Request, exc: TransportError) -> JSONResponse:
        return _error(_transfer_status(exc), "kv_transport", str(exc), kind=type(exc).__name__,
                      mismatches=getattr(exc, "mismatches", None))  # fmt: skip

    @app.exception_handler(NoRoom)
    async def no_room(_: Request, exc: NoRoom) -> JSONResponse:
        return _error(503, "no_room", str(exc))

    @app.exception_handler(ValueError)
    async def bad_request(_: Request, exc: ValueError) -> JSONResponse:
        return _error(400, "invalid_request", str(exc))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, exc: EngineDeadError) -> JSONResponse:
        return _error(503, "engine_dead", str(exc))

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        return _error(500, "internal", f"{type(exc).__name__}: {exc}")


async def _ndjson(lines: AsyncIterator[StreamLine], stream: bool) -> StreamingResponse | JSONResponse:
    """Run the stream up to its first line before answering, so that errors get a status."""
    first = await anext(lines, None)
    if not stream:
        got = [first] if first is not None else []
        got += [line async for line in lines]
        if not got:
            return _error(500, "internal", "the engine produced no output")
        tokens = [t for line in got for t in line.token_ids]
        last = got[-1]
        body = {**last.model_dump(), "offset": 0, "token_ids": tokens, "text": "".join(x.text for x in got)}
        return JSONResponse(body)

    async def body() -> AsyncIterator[bytes]:
        try:
            if first is not None:
                yield first.model_dump_json().encode() + b"\n"
            async for line in lines:
                yield line.model_dump_json().encode() + b"\n"
        finally:
            with contextlib.suppress(Exception):
                await lines.aclose()  # type: ignore[attr-defined]  # aborts an unfinished request

    return StreamingResponse(body(), media_type=NDJSON)


def _require_token(app: FastAPI, token: str) -> None:
    """Every endpoint but GET /health answers 401 without `Authorization: Bearer <token>`."""
    expected = f"Bearer {token}".encode()

    @app.middleware("http")
    async def check(request: Request, call_next: Callable) -> Any:
        if request.url.path != "/health":
            got = request.headers.get("authorization", "").encode()
            if not hmac.compare_digest(got, expected):
                return _error(401, "unauthorized", "this worker wants the deployment's worker token")
        return await call_next(request)


def build_app(worker: Worker, on_ready: Callable[[], None] | None = None) -> FastAPI:
    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        if on_ready is not None:
            on_ready()
        yield
        await worker.close()

    app = FastAPI(title=f"splitserve {worker.config.role} worker", lifespan=lifespan)
    _install_errors(app)
    if worker.config.http_auth:
        _require_token(app, worker_token(worker.config.kv_secret or ""))

    @app.post("/prefill", response_model=PrefillResponse)
    async def prefill(req: PrefillRequest) -> PrefillResponse:
        return await worker.prefill(req)

    @app.post("/decode", response_model=None)
    async def decode(req: DecodeRequest) -> StreamingResponse | JSONResponse:
        return await _ndjson(worker.decode(req), req.stream)

    @app.post("/generate", response_model=None)
    async def generate(req: GenerateRequest) -> StreamingResponse | JSONResponse:
        return await _ndjson(worker.generate(req), req.stream)

    @app.post("/abort")
    async def abort(req: AbortRequest) -> dict:
        worker.abort(req.request_id)
        return {"ok": True}

    @app.get("/health")
    async def health() -> dict:
        return worker.health()

    @app.get("/stats")
    async def stats() -> dict:
        return await worker.stats()

    @app.post("/kv/connect")
    async def connect(req: PeerRequest) -> dict:
        return await worker.check_peer(req.address, req.timeout_s)

    @app.post("/kv/release")
    async def release(req: ReleaseRequest) -> dict:
        return worker.release(req.kv)

    @app.post("/kv/probe/export")
    async def probe_export(req: ProbeExportRequest) -> dict:
        return await worker.probe_export(req.num_blocks)

    @app.post("/kv/probe")
    async def probe(req: ProbeRequest) -> dict:
        return await worker.probe(req.kv, req.timeout_s)

    @app.post("/debug/faults")
    async def faults(req: FaultsRequest) -> dict:
        return worker.set_faults(req)

    return app


def serve(worker: Worker, host: str, port: int, on_ready: Callable[[str], None]) -> None:
    """Bind (port 0: the OS picks), then serve until SIGINT / SIGTERM; `on_ready(url)` once listening."""
    sock, url = listen(host, port)
    app = build_app(worker, lambda: on_ready(url))
    config = uvicorn.Config(app, log_level="warning", lifespan="on", timeout_graceful_shutdown=5,
                            timeout_keep_alive=KEEP_ALIVE_S)  # fmt: skip
    uvicorn.Server(config).run(sockets=[sock])


__all__ = ["build_app", "serve"]
