"""After a 500 the keep-alive connection stays open, so the client's next request on it
works. A real uvicorn serving an app with our middleware and one route that raises."""

from __future__ import annotations

import asyncio
import socket
import threading

import httpx
import uvicorn
from fastapi import FastAPI

from splitserve.router.contain import ContainErrors


def _app() -> FastAPI:
    app = FastAPI()
    app.add_middleware(ContainErrors)

    @app.get("/boom")
    async def boom() -> dict:
        raise RuntimeError("a bug")

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    return app


def test_a_500_keeps_the_connection() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(_app(), log_level="critical"))
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    try:
        while not server.started:
            thread.join(0.05)
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
            for _ in range(5):
                r = client.get("/boom")
                assert r.status_code == 500 and r.json()["error"]["type"] == "server_error"
                assert r.headers.get("connection") != "close"
                assert client.get("/ok").json() == {"ok": True}
            pool = client._transport._pool  # one connection served all ten requests
            assert len(pool.connections) == 1
    finally:
        server.should_exit = True
        thread.join(10)
