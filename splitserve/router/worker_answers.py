"""What a worker's answers mean to the router: NDJSON lines read off a stream, a line -> a `Piece`, and a
worker's failure or error answer -> the client's `APIError` (dispatch.py drives the requests)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec

from splitserve.router.openai_protocol import APIError
from splitserve.sampling.logprobs import TokenLogprob
from splitserve.wire.http import StreamLine, Timings
from splitserve.wire.role import ROLE_CHANGED, RoleStamp


class WorkerEndpoint(Protocol):
    name: str
    role: str
    url: str | None
    inflight: int

    @property
    def ready(self) -> bool: ...


@dataclass
class Piece:
    """New output of one choice: tokens, their text and logprobs, and whether it is the last."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[TokenLogprob] | None = None
    finish_reason: str | None = None
    finished: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)  # the first piece: where the time went
    # a paced early first piece (first_token.py): set by the run once its consumer has written it out
    # and asks for the next; the decode request waits for it
    taken: asyncio.Event | None = None


async def lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines, however long (aiohttp's readline stops at 64 KiB), empty ones skipped."""
    buf = b""
    while True:
        chunk = await content.readany()
        if not chunk:
            if buf.strip():
                yield buf
            return
        buf += chunk
        if b"\n" not in chunk:
            continue
        *full, buf = buf.split(b"\n")
        for line in full:
            if line:
                yield line


def piece(worker: WorkerEndpoint, line: StreamLine, index: int) -> Piece:
    if line.finished and line.finish_reason == ROLE_CHANGED:
        raise APIError(503, f"worker {worker.name} changed role under the request", type="server_error",
                       code=ROLE_CHANGED)  # fmt: skip
    if line.finished and line.finish_reason in (None, "abort", "error"):
        raise APIError(
            502,
            f"worker {worker.name} ended the request without finishing it ({line.finish_reason})",
            type="server_error",
            code="worker_aborted",
        )
    return Piece(index, line.token_ids, line.text, line.logprobs, line.finish_reason, line.finished,
                 timings(line.timings))  # fmt: skip


def stamp(worker: WorkerEndpoint) -> RoleStamp | None:
    """The role and epoch `worker` was picked under, for its worker to check (None: the runtime keeps
    no role epochs)."""
    epoch = getattr(worker, "epoch", None)
    return None if epoch is None else RoleStamp(worker.role, epoch)


def timings(t: Timings | None) -> dict[str, Any]:
    """A worker's timings as the router's metrics read them (the fields it measured)."""
    return {} if t is None else msgspec.to_builtins(t)


as_json = msgspec.json.Encoder().encode


def worker_failed(worker: WorkerEndpoint, stage: str, exc: BaseException) -> APIError:
    return APIError(
        502,
        f"the {stage} worker {worker.name} failed: {type(exc).__name__}: {exc}".rstrip(": "),
        type="server_error",
        code="worker_failed",
    )


def stream_cut(worker: WorkerEndpoint) -> APIError:
    return APIError(
        502,
        f"worker {worker.name} closed the stream before the request finished (it may have died)",
        type="server_error",
        code="worker_failed",
    )


def worker_error(worker: WorkerEndpoint, status: int, content: bytes) -> APIError:
    """A worker's error answer -> the client's: its input errors stay 400, the rest are ours."""
    try:
        err = json.loads(content).get("error", {})
        message, kind = err.get("message", ""), err.get("type", "")
    except (ValueError, AttributeError):
        message, kind = content[:200].decode(errors="replace"), ""
    if status == 400:
        return APIError(400, message or "the worker refused the request")
    if status == 409 and kind == "stale_role":  # it changed role since it was picked: pick again (migrate.py)
        return APIError(409, f"{worker.name}: {message}", type="server_error", code="stale_role")
    if status == 504:
        return APIError(504, f"{worker.name}: {message}", type="timeout", code="kv_transfer_timeout")
    if status == 503:
        return APIError(
            503,
            f"{worker.name}: {message}",
            type="service_unavailable",
            code=kind or None,
            headers={"Retry-After": "1"},
        )
    return APIError(
        502, f"{worker.name} answered {status}: {message}", type="server_error", code=kind or None
    )


__all__ = [
    "Piece",
    "WorkerEndpoint",
    "as_json",
    "lines",
    "piece",
    "stamp",
    "stream_cut",
    "timings",
    "worker_error",
    "worker_failed",
]
