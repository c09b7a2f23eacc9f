"""The API's routes and error handlers on a FastAPI app: the generating routes (endpoints.py), the
utility routes (utility_routes.py: tokenize, detokenize, ...), models, the admin routes (admin.py),
/health and /metrics, behind the access log, the docs guard and error containment. Errors: an `APIError`
answers its own status and OpenAI-style body; any other exception is a 500 that names only its type.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from splitserve.router import endpoints
from splitserve.router.access_log import AccessLog
from splitserve.router.admin import install_admin_routes
from splitserve.router.contain import ContainErrors
from splitserve.router.edge_gate import EdgeGate
from splitserve.router.guard import METRICS_TYPE, DocsGuard, MetricsEndpoint
from splitserve.router.openai_protocol import APIError
from splitserve.router.server import OpenAIServer
from splitserve.router.utility_routes import install_utility_routes

log = logging.getLogger(__name__)


def build_api(server: OpenAIServer, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="splitserve", lifespan=lifespan)
    install_routes(app, lambda: server)
    cors = server.manifest.server.cors
    if cors is not None:  # outermost: a preflight (OPTIONS) is answered before auth and routing
        app.add_middleware(CORSMiddleware, allow_origins=cors.allowed_origins,
                           allow_methods=cors.allowed_methods, allow_headers=cors.allowed_headers,
                           allow_credentials=cors.allow_credentials)  # fmt: skip
    return app


def install_routes(app: FastAPI, get: Callable[[], OpenAIServer]) -> None:
    """The API's routes and error handlers on `app`, over the server `get()` returns (the Ray ingress
    builds its app at import time and its server later, in the replica)."""
    app.add_middleware(ContainErrors)  # inside the access log: a 500 answered here keeps the connection
    app.add_middleware(DocsGuard, get=get)  # /docs, /redoc, /openapi.json behind the API key
    app.add_middleware(AccessLog, get=get)  # the access log line, and errors counted by status
    app.add_middleware(EdgeGate, get=get)  # 401, 429 from the headers alone, before all of the above
    app.add_middleware(MetricsEndpoint, get=get)  # GET /metrics: a snapshot's bytes, first of all

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else None
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail), code=kind).body(), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = APIError(500, f"internal error ({type(exc).__name__})", type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        get().check_auth(request)
        return get().models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        get().check_auth(request)
        get().check_model(model_id)
        return get().model_card(model_id)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await endpoints.chat(get(), request)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await endpoints.completions(get(), request)

    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request) -> Response:
        return await endpoints.responses(get(), request)

    install_utility_routes(app, get)

    install_admin_routes(app, get)

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = get().health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        """Reached with server.metrics_auth on (MetricsEndpoint answers the open case itself)."""
        server = get()
        server.check_auth(request)
        # ?fresh=1: the next snapshot (at most a second away), for a reader that just caused something
        body = await server.metrics_cache.get(fresh=request.query_params.get("fresh") in ("1", "true"))
        return Response(body, media_type=METRICS_TYPE)


__all__ = ["build_api", "install_routes"]
