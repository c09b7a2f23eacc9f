"""The listening socket the router and workers serve on."""

from __future__ import annotations

import asyncio
import socket

from splitserve.web.listen import listen


async def test_accepted_connections_have_nagle_off() -> None:
    """asyncio turns TCP_NODELAY on for accepted connections only when the listener is IPPROTO_TCP;
    with Nagle on, a reused keep-alive connection delays the first streamed chunk by ~40 ms."""
    sock, url = listen("127.0.0.1", 0)
    accepted: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    async def on_connect(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        conn = writer.get_extra_info("socket")
        accepted.set_result(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
        writer.close()

    server = await asyncio.start_server(on_connect, sock=sock)
    port = int(url.rsplit(":", 1)[1])
    _, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        assert await asyncio.wait_for(accepted, 5) != 0
    finally:
        writer.close()
        server.close()
        await server.wait_closed()
