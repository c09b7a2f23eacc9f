"""Fetcher side of a connection: a blocking socket with a deadline on every call, the client half of the
handshake, and a pool of authenticated connections per exporter.

Life of a fetch on the wire (see protocol.py for the frames):
  1. `ConnectionPool.connection(address)` hands out an idle connection that is still open, or
     connects and runs `client_handshake` (layouts + shared secret, both directions).
  2. The transport sends its request and reads the answer with `SyncChannel.recv` /
     `recv_stream` (straight into the destination buffers, `recvmsg_into`).
  3. On success the connection goes back to the pool; on any exception it is closed, since its state
     in the middle of a frame is unknown.

Every mover's fetch takes its connection with `ConnectionPool.for_handle` (which refuses an exporter
whose layout is not the handle's), asks with `fetch_frame`, and counts its failures with
`counted_failures`.
"""

from __future__ import annotations

import array
import logging
import os
import socket
import threading
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, TypeVar

import numpy as np

from splitserve.transport.errors import AuthError, PeerRefused, TransferTimeout, TransportError
from splitserve.transport.frames import (
    Challenge,
    Error,
    Fetch,
    Frame,
    Hello,
    MalformedFrame,
    Select,
    Welcome,
    op,
)
from splitserve.transport.layout import KVLayout
from splitserve.transport.payload import ByteStream
from splitserve.transport.protocol import (
    PREFIX,
    Deadline,
    decode_header,
    decode_prefix,
    encode_frame,
    expect,
    kernel_timeout,
    new_nonce,
    proof,
    proof_ok,
)
from splitserve.wire.kv_handle import KVHandle

if TYPE_CHECKING:
    from splitserve.transport.transport import TransportStats

log = logging.getLogger(__name__)
T = TypeVar("T")
_FD_ROOM = socket.CMSG_SPACE(4 * array.array("i").itemsize)  # ancillary room for a few passed fds


def parse_address(address: str) -> tuple[socket.AddressFamily, Any]:
    """ "unix:/path" -> (AF_UNIX, path); "host:port" or "[v6]:port" -> (AF_INET[6], (host, port))."""
    if address.startswith("unix:"):
        return socket.AF_UNIX, address[len("unix:") :]
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise ValueError(f"bad exporter address {address!r}; expected host:port or unix:/path")
    if host.startswith("["):
        return socket.AF_INET6, (host[1:-1], int(port))
    return socket.AF_INET, (host, int(port))


class SyncChannel:
    """One blocking connection; every call takes the deadline it must finish by."""

    def __init__(self, sock: socket.socket, address: str) -> None:
        self.sock = sock
        self.address = address
        self.peer_layout: KVLayout | None = None
        self.attached: dict[str, Any] = {}  # per-connection resources a backend keeps (shm mapping)
        self.fds: list[int] = []  # file descriptors the exporter passed (unix sockets), not yet taken

    @classmethod
    def connect(cls, address: str, deadline: Deadline) -> SyncChannel:
        family, target = parse_address(address)
        sock = socket.socket(family, socket.SOCK_STREAM)
        try:
            sock.settimeout(deadline.remaining(f"connect to {address}"))
            sock.connect(target)
        except TimeoutError as exc:
            sock.close()
            raise TransferTimeout(f"connect to {address}: no answer within {deadline.total_s:.3g}s") from exc
        except OSError as exc:
            sock.close()
            raise TransportError(f"connect to {address}: {exc}") from exc
        if family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock.settimeout(None)  # blocking from here on; `_io` sets kernel timeouts per call
        return cls(sock, address)

    def _io(self, what: str, deadline: Deadline, op: Callable[[], T], sending: bool = False) -> T:
        """Run a blocking socket call under a kernel timeout (SO_RCVTIMEO / SO_SNDTIMEO) of what is left
        of the deadline: unlike socket.settimeout (poll, then a non-blocking call) the call sleeps in
        the kernel until done, which saves a wake-up per chunk of a large payload."""
        kernel_timeout(self.sock, deadline.remaining(what), sending)
        try:
            return op()
        except (TimeoutError, BlockingIOError) as exc:
            raise TransferTimeout(
                f"{what} from {self.address}: deadline of {deadline.total_s:.3g}s passed"
            ) from exc
        except OSError as exc:
            raise TransportError(f"{what} with {self.address}: {exc}") from exc

    def send(self, frame: Frame, deadline: Deadline) -> None:
        data = encode_frame(frame)
        self._io(f"send {op(frame)}", deadline, lambda: self.sock.sendall(data), sending=True)

    def recv_exact(self, nbytes: int, deadline: Deadline, what: str = "receive") -> bytes:
        buf = np.empty(nbytes, dtype=np.uint8)
        self.recv_stream(ByteStream([buf]), deadline, what)
        return buf.tobytes()

    def recv(self, deadline: Deadline) -> tuple[Frame, int]:
        """-> (the frame's header, body length); the body, if any, is the caller's to read."""
        header_len, body_len = decode_prefix(self.recv_exact(PREFIX.size, deadline, "receive frame"))
        return decode_header(self.recv_exact(header_len, deadline, "receive header")), body_len

    def recv_stream(self, stream: ByteStream, deadline: Deadline, what: str = "receive payload") -> None:
        """Fill every byte of `stream` from the socket, in place."""
        pos = 0
        while pos < stream.nbytes:
            window = stream.window(pos)
            got = self._io(what, deadline, lambda w=window: self._recv_into(w))
            if got == 0:
                raise TransportError(
                    f"{what}: {self.address} closed the connection after {pos} of {stream.nbytes} bytes"
                )
            pos += got

    def _recv_into(self, window: list) -> int:
        # NOTE: MSG_WAITALL is safe: a window never asks for more than the frame being read
        nbytes, ancillary, _flags, _addr = self.sock.recvmsg_into(window, _FD_ROOM, socket.MSG_WAITALL)
        for level, kind, data in ancillary:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds = array.array("i")
                fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
                self.fds.extend(fds)
        return nbytes

    def alive(self) -> bool:
        """Still open and with nothing unread (a pooled connection the exporter has not closed)."""
        try:
            self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT)
        except BlockingIOError:
            return True
        except OSError:
            return False
        return False  # EOF, or stray bytes that would desynchronise the next request

    def close(self) -> None:
        for resource in self.attached.values():
            resource.close()
        self.attached.clear()
        for fd in self.fds:
            os.close(fd)
        self.fds.clear()
        self.sock.close()


def client_handshake(chan: SyncChannel, layout: KVLayout, secret: bytes, deadline: Deadline) -> KVLayout:
    """Prove the secret, check the exporter's proof and layout; -> the exporter's layout."""
    nonce_s = expect(chan.recv(deadline)[0], Challenge).nonce
    nonce_c = new_nonce()
    chan.send(
        Hello(nonce=nonce_c, layout=layout, proof=proof(secret, "client", nonce_s, nonce_c, layout)), deadline
    )
    try:
        answer = chan.recv(deadline)[0]
    except MalformedFrame as exc:
        raise TransportError(f"exporter {chan.address} answered our hello with {exc}") from exc
    if isinstance(answer, Error) and answer.code == PeerRefused.code and answer.layout is not None:
        theirs = answer.layout
        raise PeerRefused(f"exporter {chan.address} refused our KV layout", layout.mismatches(theirs))
    welcome = expect(answer, Welcome)
    peer = welcome.layout
    if not proof_ok(proof(secret, "server", nonce_s, nonce_c, peer), welcome.proof):
        raise AuthError(f"exporter {chan.address} could not prove the shared secret")
    mismatches = layout.mismatches(peer)
    if mismatches:
        refusal = PeerRefused(f"exporter {chan.address} has another KV layout", mismatches)
        chan.send(Error.of(refusal), deadline)
        raise refusal
    chan.peer_layout = peer
    return peer


class ConnectionPool:
    """Authenticated connections to exporters, reused across fetches; thread-safe.

    NOTE: an idle connection holds what it attached (shm: the exporter's whole KV cache, mapped). Once
    its exporter is gone (a killed prefill worker comes back at a new address) nobody takes it again,
    so a reaper thread closes idle connections whose peer hung up, every `reap_interval_s`.
    """

    def __init__(
        self, layout: KVLayout, secret: bytes, connect_timeout_s: float, max_idle: int = 4,
        reap_interval_s: float = 1.0,
    ) -> None:  # fmt: skip
        self.layout = layout
        self._secret = secret
        self.connect_timeout_s = connect_timeout_s
        self.max_idle = max_idle
        self.reap_interval_s = reap_interval_s
        self._idle: defaultdict[str, list[SyncChannel]] = defaultdict(list)
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._reaper: threading.Thread | None = None
        self.opened = 0
        self.reaped = 0  # idle connections closed because their exporter went away

    @contextmanager
    def connection(self, address: str, deadline: Deadline) -> Iterator[SyncChannel]:
        chan = self._take(address) or self._open(address, deadline)
        try:
            yield chan
        except BaseException:
            chan.close()
            raise
        self._give(chan)

    @contextmanager
    def for_handle(self, handle: KVHandle, deadline: Deadline) -> Iterator[SyncChannel]:
        """`connection` to the handle's exporter, refused (PeerRefused) when the exporter's layout is not
        the one the handle was made for."""
        with self.connection(handle.address, deadline) as chan:
            if chan.peer_layout is not None and chan.peer_layout.fingerprint != handle.layout_fingerprint:
                raise PeerRefused(f"handle {handle.request_id} was made for another layout")
            yield chan

    def _open(self, address: str, deadline: Deadline) -> SyncChannel:
        chan = SyncChannel.connect(address, deadline.sooner(self.connect_timeout_s))
        try:
            client_handshake(chan, self.layout, self._secret, deadline.sooner(self.connect_timeout_s))
        except BaseException:
            chan.close()
            raise
        self.opened += 1
        return chan

    def _take(self, address: str) -> SyncChannel | None:
        while True:
            with self._lock:
                if not self._idle[address]:
                    return None
                chan = self._idle[address].pop()
            if chan.alive():
                return chan
            chan.close()

    def _give(self, chan: SyncChannel) -> None:
        with self._lock:
            idle = self._idle[chan.address]
            if len(idle) < self.max_idle and not self._closed.is_set():
                idle.append(chan)
                if self._reaper is None:
                    self._reaper = threading.Thread(
                        target=self._reap_loop, name="kv-pool-reaper", daemon=True
                    )
                    self._reaper.start()
                return
        chan.close()

    def reap(self) -> int:
        """Close the idle connections whose exporter hung up (and what they attached); -> how many."""
        with self._lock:
            dead = [c for idle in self._idle.values() for c in idle if not c.alive()]
            for address in list(self._idle):
                self._idle[address] = [c for c in self._idle[address] if c not in dead]
                if not self._idle[address]:
                    del self._idle[address]
        for chan in dead:
            chan.close()
        self.reaped += len(dead)
        return len(dead)

    def _reap_loop(self) -> None:
        while not self._closed.wait(self.reap_interval_s):
            self.reap()

    def close(self) -> None:
        self._closed.set()
        with self._lock:
            chans = [c for idle in self._idle.values() for c in idle]
            self._idle.clear()
        for chan in chans:
            chan.close()


def fetch_frame(
    handle: KVHandle, deadline: Deadline, into_run: bool = False, select: Select | None = None
) -> Fetch:
    """The fetch request for the handle's lease, with the time left (and nccl's `into_run`, the part
    a fetch of some heads and state channels `select`s)."""
    timeout_s = deadline.remaining("fetch")
    return Fetch(lease_id=handle.lease_id, request_id=handle.request_id, timeout_s=timeout_s,
                 into_run=into_run, select=select)  # fmt: skip


@contextmanager
def counted_failures(stats: TransportStats, address: str) -> Iterator[None]:
    """A fetch's failures, counted in `stats`; an answer the fetch cannot use (KeyError, TypeError,
    ValueError: a value out of range, such as bad base64) becomes a TransportError naming the exporter."""
    try:
        yield
    except TransportError as exc:
        stats.error(exc)
        raise
    except (KeyError, TypeError, ValueError) as exc:
        malformed = TransportError(f"malformed answer from {address}: {exc!r}")
        stats.error(malformed)
        raise malformed from exc
