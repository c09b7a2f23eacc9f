"""Against slowloris: our HTTP servers time out slow headers and bodies and refuse huge headers;
ordinary clients do not notice. A real uvicorn with `edge_guard.guarded_protocol`, over both of
uvicorn's HTTP parsers (httptools, which it picks when installed, and h11). Unguarded, a client
sending a header byte a second would hold its connection for good, and a 16 MiB header be read whole."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import pytest
import uvicorn
from fastapi import FastAPI, Request
from uvicorn.protocols.http.h11_impl import H11Protocol
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from splitserve.web.edge_guard import ReadLimits, guarded_protocol

LIMITS = ReadLimits(header_timeout_s=1.0, body_timeout_s=1.0, max_header_bytes=16 << 10)


def _app() -> FastAPI:
    app = FastAPI()

    @app.get("/ok")
    async def ok() -> dict:
        return {"ok": True}

    @app.post("/echo")
    async def echo(request: Request) -> dict:
        return {"bytes": len(await request.body())}

    return app


@pytest.fixture(scope="module", params=[HttpToolsProtocol, H11Protocol], ids=["httptools", "h11"])
def port(request) -> Iterator[int]:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    config = uvicorn.Config(_app(), log_level="critical", http=guarded_protocol(LIMITS, request.param))
    server = uvicorn.Server(config)
    thread = threading.Thread(target=lambda: asyncio.run(server.serve(sockets=[sock])), daemon=True)
    thread.start()
    while not server.started:
        thread.join(0.05)
    yield sock.getsockname()[1]
    server.should_exit = True
    thread.join(10)


def _read_until_closed(conn: socket.socket, timeout_s: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes; -> (bytes, seconds it took)."""
    t0, got = time.monotonic(), b""
    conn.settimeout(timeout_s)
    try:
        while chunk := conn.recv(65536):
            got += chunk
    except ConnectionResetError:
        pass
    return got, time.monotonic() - t0


def test_headers_sent_a_byte_at_a_time_are_cut_off(port):
    conn = socket.create_connection(("127.0.0.1", port))
    t0 = time.monotonic()
    try:
        for b in b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Slow: " + b"a" * 100:
            conn.sendall(bytes([b]))
            time.sleep(0.05)
    except (BrokenPipeError, ConnectionResetError):
        pass
    got, _ = _read_until_closed(conn, 10)
    assert time.monotonic() - t0 < 4, "the connection outlived the header timeout"
    assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got, got


def test_an_idle_connection_is_closed_without_an_answer(port):
    conn = socket.create_connection(("127.0.0.1", port))
    got, took = _read_until_closed(conn, 10)
    assert got == b"" and took < 4


def test_a_huge_header_gets_431_before_it_is_read_whole(port):
    conn = socket.create_connection(("127.0.0.1", port))
    sent = 0
    try:
        conn.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Big: ")
        chunk = b"a" * 65536
        while sent < 16 << 20:
            conn.sendall(chunk)
            sent += len(chunk)
    except (BrokenPipeError, ConnectionResetError):
        pass
    got, _ = _read_until_closed(conn, 10)
    assert sent < 16 << 20, "the server read a 16 MiB header"
    # 431 from the guard; h11 has a limit of its own (16 KiB) that answers 400 first
    assert got == b"" or got.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), got


@pytest.mark.parametrize("size, refused", [(20_000, True), (15_000, False)])
def test_a_header_over_the_limit_in_one_piece_is_refused(port, size, refused):
    """The whole head in one send (its last bytes complete it in the same read): measured all the same."""
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(b"GET /ok HTTP/1.1\r\nHost: x\r\nX-Big: " + b"a" * size + b"\r\nConnection: close\r\n\r\n")
    got, _ = _read_until_closed(conn, 10)
    if refused:  # h11 has a limit of its own (16 KiB) that may answer 400 first
        assert got.startswith((b"HTTP/1.1 431", b"HTTP/1.1 400")), got[:200]
    else:
        assert got.startswith(b"HTTP/1.1 200"), got[:200]


def test_a_slow_body_gets_408(port):
    conn = socket.create_connection(("127.0.0.1", port))
    conn.sendall(b"POST /echo HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: 100\r\n\r\n" + b"a" * 10)  # fmt: skip
    got, took = _read_until_closed(conn, 10)
    assert got.startswith(b"HTTP/1.1 408") and b"request_timeout" in got, got
    assert 0.5 < took < 4


def test_ordinary_clients_are_unaffected(port):
    with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=10) as client:
        assert client.get("/ok").json() == {"ok": True}
        time.sleep(1.5)  # idle on keep-alive past the header timeout: still served
        assert client.get("/ok").json() == {"ok": True}
        big = b"x" * (2 << 20)  # a 2 MiB body arrives in many reads, none of them headers
        assert client.post("/echo", content=big).json() == {"bytes": len(big)}

        def slowish() -> Iterator[bytes]:  # a body in pieces, well inside the body timeout
            for _ in range(4):
                time.sleep(0.1)
                yield b"y" * 1000

        assert client.post("/echo", content=slowish()).json() == {"bytes": 4000}
        assert len(client._transport._pool.connections) == 1  # one keep-alive connection for all
