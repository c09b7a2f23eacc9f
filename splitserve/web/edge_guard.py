"""Read limits on our HTTP servers' connections (against slowloris): a request's headers must
arrive within `header_timeout_s` of its first byte (or of the connection) and fit in
`max_header_bytes`; its body must arrive within `body_timeout_s` of its headers.

uvicorn has none of these (httptools buffers a header of any size; a client sending a byte a second
holds a connection forever), so `guarded_protocol` subclasses uvicorn's own HTTP protocol (httptools,
or h11 without it) and watches each connection from outside the parser:
  - headers are pending while no request is being read (`cycle` is None or its body is complete);
    bytes received then are counted, and a timer runs from the first of them; the chunk that
    completes them is not counted (it may hold body bytes too): the parsed head is measured instead;
  - a new `cycle` after `data_received` means the headers completed; its body is pending until
    `cycle.more_body` turns False, under the body timer.
A slow or oversized request gets 408 or 431 (OpenAI's error body) and the connection is closed; the
app sees a disconnect (an access line with 499). A connection that never sent a byte is just closed.
"""

from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.auto import AutoHTTPProtocol


@dataclass(frozen=True)
class ReadLimits:
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    max_header_bytes: int = 64 << 10


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(
        {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": code}}
    ).encode()
    head = (f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n")  # fmt: skip
    return head.encode() + body


def _header_size(scope: dict) -> int:
    """The bytes of a parsed request's head: the request line and each `name: value` line."""
    line = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"") + 16
    return line + sum(len(k) + len(v) + 4 for k, v in scope.get("headers", ()))


def guarded_protocol(
    limits: ReadLimits, base: type[asyncio.Protocol] | None = None
) -> type[asyncio.Protocol]:
    """uvicorn's HTTP protocol class (`base`: the one uvicorn picks) with `limits` enforced; pass it as
    `uvicorn.Config(http=...)`."""

    class Guarded(base or AutoHTTPProtocol):  # type: ignore[misc, valid-type]
        _timer: asyncio.TimerHandle | None = None
        _header_bytes = 0

        def connection_made(self, transport: Any) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm(limits.header_timeout_s, self._headers_late)

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            before = self.cycle
            awaiting_headers = before is None or not before.more_body
            super().data_received(data)
            cycle = self.cycle
            if self.transport.is_closing():
                self._disarm()
            elif cycle is not before:  # headers complete: the body (if any) is under its own clock
                self._header_bytes = 0
                self._disarm()
                if _header_size(cycle.scope) > limits.max_header_bytes:  # their last bytes came just now
                    self._refuse(431, "Request Header Fields Too Large", "request_header_fields_too_large",
                                 f"the request's headers exceed {limits.max_header_bytes} bytes")  # fmt: skip
                elif cycle.more_body:
                    self._arm(limits.body_timeout_s, self._body_late)
            elif awaiting_headers:
                self._header_bytes += len(data)
                if self._header_bytes > limits.max_header_bytes:
                    self._refuse(431, "Request Header Fields Too Large", "request_header_fields_too_large",
                                 f"the request's headers exceed {limits.max_header_bytes} bytes")  # fmt: skip
                elif self._timer is None:
                    self._arm(limits.header_timeout_s, self._headers_late)
            elif cycle is not None and not cycle.more_body:
                self._disarm()  # the body is complete

        def _arm(self, delay_s: float, fn: Any) -> None:
            self._disarm()
            self._timer = self.loop.call_later(delay_s, fn)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _headers_late(self) -> None:
            self._timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                # a pipelined request waits for the response in progress: the client is not slow
                self._arm(limits.header_timeout_s, self._headers_late)
            elif self._header_bytes == 0:
                self.transport.close()  # nothing was sent: an idle connection, no answer owed
            else:
                late = f"the request's headers took longer than {limits.header_timeout_s:g} s"
                self._refuse(408, "Request Timeout", "request_timeout", late)

        def _body_late(self) -> None:
            self._timer = None
            cycle = self.cycle
            if cycle is None or not cycle.more_body:
                return
            if cycle.response_started:
                self.transport.close()
            else:
                late = f"the request's body took longer than {limits.body_timeout_s:g} s"
                self._refuse(408, "Request Timeout", "request_timeout", late)

        def _refuse(self, status: int, reason: str, code: str, message: str) -> None:
            self._disarm()
            if not self.transport.is_closing():
                self.transport.write(_response(status, reason, message, code))
                self.transport.close()

    return Guarded


__all__ = ["ReadLimits", "guarded_protocol"]
