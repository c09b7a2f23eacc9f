"""The KV wire protocol: frames, the authenticated handshake, deadlines and payload checksums.

A frame is a fixed prefix, a JSON header and a raw binary body (no pickle anywhere):

    prefix  = magic b"SSKV" | protocol version u16 | flags u16 | header length u32 | body length u64
    header  = one of frames.py's structs as JSON, told apart by its "op"
    body    = body-length raw bytes (only the exporter sends bodies: the KV payload)

Life of a connection (fetcher = client, exporter = server):
  1. server -> challenge {nonce_s}
  2. client -> hello {nonce_c, proof_c = HMAC(secret, "client" nonce_s nonce_c layout_c), layout_c}
  3. server: proof_c wrong -> error "auth", close. Layouts differ -> error "layout" with the list of
     mismatches, close. Else -> welcome {proof_s = HMAC(secret, "server" nonce_s nonce_c layout_s), layout_s}
  4. client: proof_s wrong -> AuthError; layouts differ -> it refuses too (PeerRefused).
     Nothing about the KV is sent before step 3 succeeds.
  5. requests, any number, one at a time:
       fetch   {lease_id, timeout_s} -> "kv" header + payload (tcp) or the shm dialogue (stream/shm.py)
       release {lease_id}            -> ok
     an exporter that cannot serve answers error {code, message} (errors.py).

Every receive and send runs against a `Deadline`; running past it is `TransferTimeout`.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import socket
import struct
import time
import zlib
from collections.abc import Iterable
from dataclasses import dataclass

from splitserve.transport.errors import AuthError, PeerRefused, TransferTimeout, TransportError
from splitserve.transport.frames import Error, F, Frame, decode, encode, op
from splitserve.transport.layout import PROTOCOL_VERSION, KVLayout

MAGIC = b"SSKV"
PREFIX = struct.Struct("!4sHHIQ")  # magic, version, flags, header length, body length
MAX_HEADER_BYTES = 1 << 20
SECRET_ENV = "SPLITSERVE_KV_SECRET"
CHECKSUMS = ("crc32", "blake2b")


@dataclass(frozen=True)
class Deadline:
    at: float  # time.monotonic()
    total_s: float

    @classmethod
    def after(cls, seconds: float) -> Deadline:
        return cls(time.monotonic() + seconds, seconds)

    def remaining(self, what: str = "transfer") -> float:
        """Seconds left; raises TransferTimeout once none are."""
        left = self.at - time.monotonic()
        if left <= 0:
            raise TransferTimeout(f"{what}: deadline of {self.total_s:.3g}s passed")
        return left

    def sooner(self, seconds: float) -> Deadline:
        return self if self.at - time.monotonic() <= seconds else Deadline.after(seconds)


_TIMEVAL = struct.Struct("@ll")  # struct timeval


def kernel_timeout(sock: socket.socket, seconds: float, sending: bool) -> None:
    """Bound the next blocking send (recv) on `sock` in the kernel (SO_SNDTIMEO / SO_RCVTIMEO): the call
    sleeps in the kernel until done or timed out (EAGAIN), with no user-space wake-up in between."""
    timeval = _TIMEVAL.pack(int(seconds), max(1, int(seconds % 1 * 1e6)))
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO if sending else socket.SO_RCVTIMEO, timeval)


# -- frames -----------------------------------------------------------------------------------------
def encode_frame(frame: Frame, body_nbytes: int = 0) -> bytes:
    """Prefix + header bytes; the body (if any) is sent right after, from its own buffers."""
    data = encode(frame)
    return PREFIX.pack(MAGIC, PROTOCOL_VERSION, 0, len(data), body_nbytes) + data


def decode_prefix(raw: bytes) -> tuple[int, int]:
    """-> (header length, body length); refuses a foreign stream or another protocol version."""
    magic, version, _flags, header_len, body_len = PREFIX.unpack(raw)
    if magic != MAGIC:
        raise TransportError(f"not a splitserve KV peer (magic {magic!r})")
    if version != PROTOCOL_VERSION:
        raise PeerRefused(
            "protocol version differs", [f"protocol_version: ours {PROTOCOL_VERSION}, peer {version}"]
        )
    if header_len > MAX_HEADER_BYTES:
        raise TransportError(f"frame header of {header_len} bytes is over the {MAX_HEADER_BYTES} limit")
    return header_len, body_len


def decode_header(raw: bytes) -> Frame:
    """The frame a header holds; MalformedFrame (a TransportError) when it holds none (frames.py)."""
    return decode(raw)


def expect(frame: Frame, kind: type[F]) -> F:
    """`frame` if it is a `kind`; an error frame becomes its exception; anything else is a fault."""
    if isinstance(frame, kind):
        return frame
    if isinstance(frame, Error):
        raise frame.exception()
    raise TransportError(f"protocol error: expected {op(kind)!r}, got {op(frame)!r}")


# -- authentication --------------------------------------------------------------------------------
def resolve_secret(secret: bytes | str | None) -> bytes:
    """The shared secret from the argument, else from $SPLITSERVE_KV_SECRET; none is a start-up error."""
    if secret is None:
        secret = os.environ.get(SECRET_ENV)
    if not secret:
        raise AuthError(f"no KV transport secret: pass secret= or set ${SECRET_ENV} (same on every worker)")
    return secret.encode() if isinstance(secret, str) else bytes(secret)


def new_nonce() -> str:
    return secrets.token_hex(32)


def proof(secret: bytes, role: str, nonce_s: str, nonce_c: str, layout: KVLayout) -> str:
    """HMAC-SHA256 over the role, both nonces and the sender's layout (so a layout cannot be swapped)."""
    message = "|".join((role, nonce_s, nonce_c, layout.fingerprint)).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def proof_ok(expected: str, got: object) -> bool:
    return isinstance(got, str) and hmac.compare_digest(expected.encode(), got.encode())


# -- payload checksums ------------------------------------------------------------------------------
def checksum(algo: str, buffers: Iterable) -> str:
    """`algo:hex` over the concatenation of `buffers` (anything with the buffer protocol)."""
    if algo == "crc32":
        crc = 0
        for buf in buffers:
            crc = zlib.crc32(buf, crc)
        return f"crc32:{crc:08x}"
    if algo == "blake2b":
        h = hashlib.blake2b(digest_size=16)
        for buf in buffers:
            h.update(buf)
        return f"blake2b:{h.hexdigest()}"
    raise ValueError(f"unknown checksum {algo!r}; choose one of {CHECKSUMS}")


def checksum_like(example: str | None, buffers: Iterable) -> str | None:
    """The checksum of `buffers` by the algorithm of `example` (None: none). An exporter answering a
    fetch for part of a payload sends this, since the export's own checksum covers the whole."""
    return checksum(checksum_algo(example), buffers) if example else None


def checksum_algo(value: str) -> str:
    algo = value.split(":", 1)[0]
    if algo not in CHECKSUMS:
        raise TransportError(f"peer used an unknown checksum {value!r}")
    return algo
