"""The admin routes, behind the API key:

    GET  /admin/deployment              what `splitserve verify` needs: workers, backends, thresholds
    POST /admin/workers/{name}/role     RoleChangeRequest -> RoleChangeResult (wire/role.py): the worker
                                        drains, restarts its engine core in the other role and rejoins

A role change answers 200 once the worker serves its new role; 404 for an unknown worker; 409 when the
worker is not ready, already has that role, is changing role already, or is the last ready worker of
its role (unless `force`); 501 where the runtime cannot change roles. The local runtime's switch is
runtime/role_switch.py, the Ray runtime's runtime/ray_role.py.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import Response

from splitserve.router.openai_protocol import APIError
from splitserve.wire.role import RoleChangeRequest

if TYPE_CHECKING:
    from splitserve.router.server import OpenAIServer


def install_admin_routes(app: FastAPI, get: Callable[[], OpenAIServer]) -> None:
    @app.get("/admin/deployment")
    async def deployment(request: Request) -> dict:
        get().check_auth(request)
        return get().deployment()

    @app.post("/admin/workers/{name}/role")
    async def change_role(name: str, request: Request) -> Response:
        server = get()
        server.check_auth(request)
        body = await server.read_json(request)
        try:
            change = msgspec.convert(body, RoleChangeRequest)
        except msgspec.ValidationError as exc:
            raise APIError(400, f"invalid role change: {exc}", code="invalid_request") from None
        if server.change_role is None:
            raise APIError(501, "this deployment's runtime does not change worker roles",
                           type="server_error", code="not_supported")  # fmt: skip
        result = await server.change_role(name, change)
        return Response(msgspec.json.encode(result), media_type="application/json")


__all__ = ["install_admin_routes"]
