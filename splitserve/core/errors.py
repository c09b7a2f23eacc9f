"""The status and body a worker answers with for an exception of the engine or the transport (the engine
core puts it in a `Refused` or a `Reply`; ops.py for the worker operations)."""

from __future__ import annotations

from splitserve.wire import core as wire


def error_info(exc: BaseException) -> wire.ErrorInfo:
    """An exception of the engine or the transport -> the status and body the worker answers with."""
    from splitserve.engine.grammar import GrammarTimeout
    from splitserve.engine.kv_transfer_types import KVTransferFailed, NoRoom
    from splitserve.transport import AuthError, PeerRefused, TransferTimeout, TransportError

    def transfer_status(e: BaseException) -> int:
        for cls, status in ((AuthError, 403), (PeerRefused, 409), (TransferTimeout, 504), (NoRoom, 503)):
            if isinstance(e, cls):
                return status
        return 502

    if isinstance(exc, KVTransferFailed):
        extra = {"kind": exc.kind, "request_id": exc.request_id,
                 "mismatches": getattr(exc.cause, "mismatches", None)}  # fmt: skip
        return wire.ErrorInfo(transfer_status(exc.cause), "kv_transfer_failed", str(exc), extra)
    if isinstance(exc, TransportError):
        extra = {"kind": type(exc).__name__, "mismatches": getattr(exc, "mismatches", None)}
        return wire.ErrorInfo(transfer_status(exc), "kv_transport", str(exc), extra)
    if isinstance(exc, NoRoom):
        return wire.ErrorInfo(503, "no_room", str(exc))
    if isinstance(exc, GrammarTimeout):
        return wire.ErrorInfo(503, "grammar_timeout", str(exc))
    if isinstance(exc, ValueError):
        return wire.ErrorInfo(400, "invalid_request", str(exc))
    return wire.ErrorInfo(500, "internal", f"{type(exc).__name__}: {exc}")
