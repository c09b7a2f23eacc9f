"""A listening socket for an HTTP server (the workers' and the router's), bound before uvicorn starts."""

from __future__ import annotations

import socket

# Idle keep-alive connections stay open this long on our HTTP servers: far past the 5 s after which
# httpx clients (the router's, the official openai client's) stop reusing one. With both at 5 s (the
# uvicorn default), a client could send on a connection in the instant the server closes it and get
# "connection reset by peer" for a request that never arrived.
KEEP_ALIVE_S = 75


def listen(host: str, port: int, backlog: int = 256) -> tuple[socket.socket, str]:
    """A bound, listening socket (port 0: the OS picks) and its URL. Connections queue from here on,
    before uvicorn takes the socket, so a URL handed out early is already safe to call."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # NOTE: protocol IPPROTO_TCP, not 0: asyncio sets TCP_NODELAY on accepted connections only when the
    # listening socket says it is TCP. With Nagle on, the first SSE chunk after the response headers
    # waits for the client's delayed ACK (about 40 ms) on every reused keep-alive connection.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(backlog)
    bound_host, bound_port = sock.getsockname()[:2]
    shown = f"[{bound_host}]" if family == socket.AF_INET6 else bound_host
    return sock, f"http://{shown}:{bound_port}"


__all__ = ["KEEP_ALIVE_S", "listen"]
