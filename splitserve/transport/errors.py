"""Transport errors, and the codes that carry them over the wire.

Every failure a fetcher can see is a `TransportError`; the subclasses name the ones a caller treats
differently (retry elsewhere, recompute, alert). An exporter that refuses a request answers with an
error frame (frames.py's `Error`: a code and a message); the fetcher turns the code back into the
same exception class (`Error.exception`).
"""

from __future__ import annotations


class TransportError(RuntimeError):
    """A transfer failed: connection lost, protocol violation, peer gone.

    `pending`: set when a GPU copy into the fetch's blocks may still be running (cuda_ipc: a copy
    that ran past the deadline, or an early copy of a fetch that failed): a CUDA event, and the
    blocks must not be given to anything else before `pending.query()` is true
    (`BlockPool.free_after`). None otherwise."""

    code = "transport"
    pending: object | None = None


class TransferTimeout(TransportError):
    """A socket operation or a whole transfer ran past its deadline."""

    code = "timeout"


class PeerRefused(TransportError):
    """The handshake found layouts (or protocol versions) that do not match."""

    code = "layout"
    authenticated = False  # set when the peer proved the shared secret before the refusal

    def __init__(self, message: str, mismatches: list[str] | None = None) -> None:
        self.mismatches = list(mismatches or [])
        detail = "; ".join(self.mismatches)
        super().__init__(f"{message}: {detail}" if detail else message)


class AuthError(TransportError):
    """The peer could not prove it holds the shared secret (or none is configured)."""

    code = "auth"


class CorruptTransfer(TransportError):
    """The payload's checksum does not match the one computed at export."""

    code = "corrupt"


class LeaseExpired(TransportError):
    """The exporter no longer holds the blocks: the lease expired or was released."""

    code = "lease_expired"


class UnknownLease(TransportError):
    """The exporter never issued this lease (wrong exporter, or it restarted)."""

    code = "unknown_lease"


class BackendUnavailable(TransportError):
    """A backend was asked for at start-up that this host or build cannot provide."""

    code = "unavailable"


_BY_CODE: dict[str, type[TransportError]] = {
    cls.code: cls
    for cls in (TransportError, TransferTimeout, AuthError, CorruptTransfer, LeaseExpired, UnknownLease)
}


def error_class(code: str) -> type[TransportError]:
    """The exception class an error frame's code names (an unknown code: TransportError)."""
    return _BY_CODE.get(code, TransportError)
