"""Exporter side of a connection: an asyncio server on a background thread, so the engine's sync code
can export and release while fetches are served.

Life of a connection at the exporter:
  1. `ExportServer.start()` binds the endpoint (tcp port 0 by default: the OS picks; or a unix socket
     path), starts the loop thread and reports the real address for the handles.
  2. Each accepted socket runs `server_handshake` within `connect_timeout_s`: a peer that cannot
     prove the secret, or has another layout, gets an error frame and is disconnected before any
     KV is sent.
  3. Then requests, one at a time, each handed to the `RequestHandler` (the transport), until the
     peer closes, stays idle past `idle_timeout_s`, or the handler says to stop.
  4. `close()` cancels every connection, closes the listening socket, removes a unix socket path.

Payloads go out with non-blocking `sendmsg` straight from the KV views (`send_stream`).
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import logging
import os
import secrets
import shutil
import socket
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any, Protocol

from splitserve.tempdirs import owned_tempdir
from splitserve.transport.errors import AuthError, PeerRefused, TransportError
from splitserve.transport.frames import Challenge, Error, Frame, Hello, MalformedFrame, Welcome, op
from splitserve.transport.layout import KVLayout
from splitserve.transport.payload import ByteStream
from splitserve.transport.protocol import (
    PREFIX,
    Deadline,
    decode_header,
    decode_prefix,
    encode_frame,
    kernel_timeout,
    new_nonce,
    proof,
    proof_ok,
)

log = logging.getLogger(__name__)

THREAD_SEND_BYTES = 4 << 20  # payloads this large are sent from a worker thread (send_stream)


@dataclass(frozen=True)
class ListenSpec:
    """Where to listen: ("tcp", host, port) with port 0 for an OS-assigned one, or ("unix", path)."""

    family: str
    host: str = ""
    port: int = 0
    path: str = ""

    def bind(self) -> tuple[socket.socket, str]:
        if self.family == "unix":
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            sock.bind(self.path)
            return sock, f"unix:{self.path}"
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        sock = socket.socket(family, socket.SOCK_STREAM)
        sock.bind((self.host, self.port))
        host, port = sock.getsockname()[:2]
        return sock, f"[{host}]:{port}" if family == socket.AF_INET6 else f"{host}:{port}"


class UnixSocketPath:
    """Where a same-host exporter (shm, cuda_ipc) puts its unix control socket: a new path in
    `socket_dir` when the options name one, else in a temp dir of ours (swept if we are SIGKILLed),
    which `close` removes."""

    def __init__(self) -> None:
        self._own_dir: str | None = None

    def listen_spec(self, socket_dir: str | None) -> ListenSpec:
        name = f"kv-{os.getpid()}-{secrets.token_hex(4)}.sock"
        return ListenSpec("unix", path=os.path.join(socket_dir or self._own(), name))

    def _own(self) -> str:
        if self._own_dir is None:
            self._own_dir = owned_tempdir("splitserve-kv-")
        return self._own_dir

    def close(self) -> None:
        if self._own_dir:
            shutil.rmtree(self._own_dir, ignore_errors=True)


class AsyncChannel:
    """One accepted connection, driven from the server loop; every call takes its deadline.

    Each operation first tries the non-blocking syscall and only waits on the loop (reader/writer
    callbacks plus one timer, no extra tasks) when the socket is not ready.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, sock: socket.socket, peer: str) -> None:
        self.loop = loop
        self.sock = sock
        self.peer = peer
        self.attached: dict[str, Any] = {}  # per-connection resources a backend keeps (shm arena)
        self.notes: set[str] = set()  # per-connection facts a backend remembers ("kv fd sent")

    async def _ready(self, writing: bool, what: str, deadline: Deadline) -> None:
        """Wait until the socket is writable (readable) or the deadline passes (-> TransferTimeout)."""
        left = deadline.remaining(f"{what} with {self.peer}")
        ready = self.loop.create_future()

        def wake() -> None:
            if not ready.done():
                ready.set_result(None)

        fd = self.sock.fileno()
        (self.loop.add_writer if writing else self.loop.add_reader)(fd, wake)
        timer = self.loop.call_later(left, wake)
        try:
            await ready
        finally:
            timer.cancel()
            (self.loop.remove_writer if writing else self.loop.remove_reader)(fd)

    async def _send_all(self, data: bytes, what: str, deadline: Deadline) -> None:
        view, sent = memoryview(data), 0
        while sent < len(view):
            try:
                sent += self.sock.send(view[sent:])
            except (BlockingIOError, InterruptedError):
                await self._ready(True, what, deadline)
            except OSError as exc:
                raise TransportError(f"{what} to {self.peer}: {exc}") from exc

    async def _recv_some(self, view: memoryview, what: str, deadline: Deadline) -> int:
        while True:
            try:
                return self.sock.recv_into(view)
            except (BlockingIOError, InterruptedError):
                await self._ready(False, what, deadline)
            except OSError as exc:
                raise TransportError(f"{what} from {self.peer}: {exc}") from exc

    async def recv_exact(self, nbytes: int, deadline: Deadline, what: str) -> bytes:
        buf = bytearray(nbytes)
        view, got = memoryview(buf), 0
        while got < nbytes:
            n = await self._recv_some(view[got:], what, deadline)
            if n == 0:
                raise TransportError(f"{what}: {self.peer} closed the connection")
            got += n
        return bytes(buf)

    async def send(
        self, header: Frame, deadline: Deadline, body_nbytes: int = 0, fds: tuple[int, ...] = ()
    ) -> None:
        """One frame (its body, if any, follows with send_stream); `fds` ride along (unix sockets)."""
        frame, what = encode_frame(header, body_nbytes), f"send {op(header)}"
        if fds:
            ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))]
            while True:
                try:
                    frame = frame[self.sock.sendmsg([frame], ancillary) :]
                    break
                except (BlockingIOError, InterruptedError):
                    await self._ready(True, what, deadline)
                except OSError as exc:
                    raise TransportError(f"{what} to {self.peer}: {exc}") from exc
        await self._send_all(frame, what, deadline)

    async def recv(self, deadline: Deadline) -> Frame:
        """The next request header; requests never carry a body."""
        header_len, body_len = decode_prefix(await self.recv_exact(PREFIX.size, deadline, "receive"))
        if body_len:
            raise TransportError(f"{self.peer} sent a request with a {body_len}-byte body")
        return decode_header(await self.recv_exact(header_len, deadline, "receive header"))

    async def send_stream(self, stream: ByteStream, deadline: Deadline, nbytes: int | None = None) -> None:
        """Send the first `nbytes` (default all) of `stream` with scatter-gather sendmsg, no copies.

        A large payload is sent from a worker thread with the socket blocking, so that each sendmsg
        sleeps in the kernel until its window is out (as a plain sendall would) instead of waking the
        loop every time the socket buffer drains."""
        pos, end = 0, stream.nbytes if nbytes is None else nbytes
        if end >= THREAD_SEND_BYTES:
            await asyncio.to_thread(self._send_blocking, stream, end, deadline)
            return
        while pos < end:
            try:
                pos += self.sock.sendmsg(stream.window(pos, end - pos))
            except (BlockingIOError, InterruptedError):
                await self._ready(True, "send payload", deadline)
            except OSError as exc:
                raise TransportError(f"send payload to {self.peer}: {exc}") from exc

    def _send_blocking(self, stream: ByteStream, end: int, deadline: Deadline) -> None:
        # NOTE: the connection's coroutine awaits this thread: nobody else touches the socket meanwhile
        self.sock.setblocking(True)
        try:
            pos = 0
            while pos < end:
                kernel_timeout(self.sock, deadline.remaining(f"send payload to {self.peer}"), sending=True)
                try:
                    pos += self.sock.sendmsg(stream.window(pos, end - pos))
                except (BlockingIOError, InterruptedError):
                    continue  # timed out in the kernel: the deadline check above says whether to go on
                except OSError as exc:
                    raise TransportError(f"send payload to {self.peer}: {exc}") from exc
        finally:
            with contextlib.suppress(OSError):
                self.sock.setblocking(False)

    async def wait_closed(self, deadline: Deadline) -> None:
        """Read and drop whatever arrives until the peer hangs up or the deadline passes."""
        view = memoryview(bytearray(4096))
        with contextlib.suppress(TransportError):
            while await self._recv_some(view, "wait", deadline):
                pass

    def close(self) -> None:
        for resource in self.attached.values():
            resource.close()
        self.attached.clear()
        with contextlib.suppress(OSError):
            self.sock.shutdown(socket.SHUT_RDWR)  # wakes a worker thread blocked in sendmsg
        self.sock.close()


async def server_handshake(
    chan: AsyncChannel, layout: KVLayout, secret: bytes, deadline: Deadline
) -> KVLayout:
    """Check the client's proof first, then its layout; answer with our proof and layout.

    Raises AuthError or PeerRefused without answering: the caller counts, then sends `refusal(...)`.
    """
    nonce_s = new_nonce()
    await chan.send(Challenge(nonce=nonce_s), deadline)
    try:
        hello = await chan.recv(deadline)
    except MalformedFrame as exc:
        raise AuthError(f"bad hello: {exc}") from exc
    if not isinstance(hello, Hello):
        raise AuthError(f"bad hello: expected hello, got {op(hello)!r}")
    nonce_c, peer = hello.nonce, hello.layout
    if not proof_ok(proof(secret, "client", nonce_s, nonce_c, peer), hello.proof):
        raise AuthError("authentication failed")
    mismatches = layout.mismatches(peer)
    if mismatches:
        refused = PeerRefused("exporter refused the layout", mismatches)
        refused.authenticated = True  # the peer proved the secret: it may see our layout
        raise refused
    await chan.send(Welcome(layout=layout, proof=proof(secret, "server", nonce_s, nonce_c, layout)), deadline)
    return peer


def refusal(exc: TransportError, layout: KVLayout) -> Error:
    """The error frame for a refused handshake. A layout refusal of a peer that proved the secret
    carries our layout, so that the fetcher can list the differences from its own side; one that did
    not prove it (another protocol version, refused before any proof) learns nothing of it."""
    shown = isinstance(exc, PeerRefused) and getattr(exc, "authenticated", False)
    return Error.of(exc, layout if shown else None)


class RequestHandler(Protocol):
    async def handle(self, chan: AsyncChannel, header: Frame) -> bool:
        """Serve one request; False closes the connection."""
        ...


class ExportServer:
    """Accepts fetchers and feeds their requests to a handler, on a loop in a background thread."""

    def __init__(
        self,
        endpoint: ListenSpec,
        layout: KVLayout,
        secret: bytes,
        handler: RequestHandler,
        connect_timeout_s: float,
        idle_timeout_s: float,
    ) -> None:
        self.endpoint = endpoint
        self.layout = layout
        self._secret = secret
        self.handler = handler
        self.connect_timeout_s = connect_timeout_s
        self.idle_timeout_s = idle_timeout_s
        self.address = ""
        self.counts: Counter[str] = Counter()
        self.loop = asyncio.new_event_loop()
        self._sock: socket.socket | None = None
        self._thread: threading.Thread | None = None
        self._tasks: set[asyncio.Task] = set()

    def start(self) -> str:
        sock, self.address = self.endpoint.bind()
        sock.listen(128)
        sock.setblocking(False)
        self._sock = sock
        self._thread = threading.Thread(target=self._run, name=f"kv-export {self.address}", daemon=True)
        self._thread.start()
        return self.address

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._spawn(self._accept_forever())
        self.loop.run_forever()

    def _spawn(self, coro: Any) -> None:
        task = self.loop.create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _accept_forever(self) -> None:
        assert self._sock is not None
        while True:
            sock, peer = await self.loop.sock_accept(self._sock)
            sock.setblocking(False)
            if sock.family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            self._spawn(self._serve(AsyncChannel(self.loop, sock, str(peer) or "unix peer")))

    async def _serve(self, chan: AsyncChannel) -> None:
        self.counts["connections"] += 1
        try:
            await server_handshake(chan, self.layout, self._secret, Deadline.after(self.connect_timeout_s))
            while await self.handler.handle(chan, await chan.recv(Deadline.after(self.idle_timeout_s))):
                pass
        except (AuthError, PeerRefused) as exc:
            self.counts[f"refused_{exc.code}"] += 1
            log.warning("kv exporter %s refused %s: %s", self.address, chan.peer, exc)
            with contextlib.suppress(TransportError, OSError):
                await chan.send(refusal(exc, self.layout), Deadline.after(self.connect_timeout_s))
        except MalformedFrame as exc:  # an authenticated peer sent a request we cannot read: say why
            self.counts["malformed_frames"] += 1
            log.warning("kv exporter %s: %s sent %s", self.address, chan.peer, exc)
            with contextlib.suppress(TransportError, OSError):
                await chan.send(Error.of(exc), Deadline.after(self.connect_timeout_s))
        except (TransportError, ConnectionError) as exc:
            log.debug("kv exporter %s: connection %s ended: %s", self.address, chan.peer, exc)
        except Exception:
            log.exception("kv exporter %s: connection %s failed", self.address, chan.peer)
        finally:
            chan.close()

    def close(self) -> None:
        if self._thread is None:
            return
        future = asyncio.run_coroutine_threadsafe(self._shutdown(), self.loop)
        with contextlib.suppress(Exception):
            future.result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)
        if not self.loop.is_running():
            self.loop.close()
        self._thread = None
        if self._sock is not None:
            self._sock.close()
        if self.endpoint.family == "unix":
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.endpoint.path)

    async def _shutdown(self) -> None:
        tasks = [t for t in self._tasks if t is not asyncio.current_task()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
