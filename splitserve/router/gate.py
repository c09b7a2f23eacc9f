"""The router's front gate: a request without a valid API key (401) or past its client's rate (429) is
answered from its headers alone, before its body is read or parsed and before anything reaches a
worker, so that a flood of refusals costs the router little and the workers nothing.

`EdgeGate` (edge_gate.py) is a plain ASGI middleware in front of everything, the access log included:
each refusal is counted (`splitserve:request_errors`) but only `LOG_LINES_PER_S` of them a second get
an access line (a line costs more than the refusal); the next line logged says how many were not.

`Gate` holds the keys and the per-client token buckets (`server.rate_limit: {requests_per_s, burst}`,
off by default): a client is its API key when keys are set, else its address. A bucket holds `burst`
requests and refills at `requests_per_s`; an empty one answers 429 with `Retry-After` (whole seconds
until a request is allowed again) in OpenAI's error format.
"""

from __future__ import annotations

import hmac
import json
import math
import time
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from splitserve.config.manifest_limits import RateLimitSection

# the routes that want a key (unknown paths go on to their 404)
GATED = {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/models", "/tokenize", "/detokenize",
         "/admin/deployment"}  # fmt: skip
GATED_PREFIXES = ("/v1/models/", "/admin/")  # and every path under these
MAX_CLIENTS = 1 << 16  # buckets kept; the least recently seen client's is dropped past this
LOG_LINES_PER_S = 10  # refusals logged a second at most (bursts of 5 s worth)


def _error(message: str, type_: str, code: str) -> bytes:
    return json.dumps({"error": {"message": message, "type": type_, "param": None, "code": code}}).encode()


UNAUTHORIZED = _error("invalid or missing API key (send 'Authorization: Bearer <key>')",
                      "invalid_request_error", "invalid_api_key")  # fmt: skip


class TokenBuckets:
    """One token bucket per client key: `take(key)` -> 0.0 if a request may go now, else the seconds
    until one may."""

    def __init__(self, rate: float, burst: int, max_clients: int = MAX_CLIENTS) -> None:
        self.rate, self.burst, self.max_clients = rate, float(burst), max_clients
        self._buckets: OrderedDict[Any, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def take(self, key: Any, now: float | None = None) -> float:
        now = time.monotonic() if now is None else now
        tokens, at = self._buckets.pop(key, (self.burst, now))
        tokens = min(self.burst, tokens + (now - at) * self.rate)
        wait = 0.0 if tokens >= 1 else (1 - tokens) / self.rate
        self._buckets[key] = (tokens - 1 if wait == 0 else tokens, now)
        if len(self._buckets) > self.max_clients:
            self._buckets.popitem(last=False)
        return wait


class Gate:
    def __init__(self, keys: list[bytes], rate_limit: RateLimitSection | None) -> None:
        self.keys = keys
        self.limit = rate_limit
        self.buckets = (
            None if rate_limit is None else TokenBuckets(rate_limit.requests_per_s, rate_limit.burst)
        )
        self.log_budget = TokenBuckets(LOG_LINES_PER_S, 5 * LOG_LINES_PER_S)
        self.unlogged = 0  # refusals counted but not logged since the last line

    def check(self, scope: dict) -> tuple[int, list[tuple[bytes, bytes]], bytes] | None:
        """None to let the request in, else (status, headers, body) to answer it with."""
        token = None
        if self.keys:
            token = _bearer(scope)
            ok = False
            for key in self.keys:  # every key compared, in constant time each
                ok |= token is not None and hmac.compare_digest(token, key)
            if not ok:
                return 401, [(b"www-authenticate", b"Bearer")], UNAUTHORIZED
        if self.buckets is None:
            return None
        client = scope.get("client")
        wait = self.buckets.take(token if token is not None else (client[0] if client else None))
        if wait == 0.0:
            return None
        after = max(1, math.ceil(wait))
        assert self.limit is not None
        who = "API key" if token is not None else "client address"
        body = _error(f"rate limit reached for this {who}: {self.limit.requests_per_s:g} requests/s, "
                      f"bursts of {self.limit.burst}; retry after {after} s", "rate_limit_error",
                      "rate_limit_exceeded")  # fmt: skip
        return 429, [(b"retry-after", str(after).encode())], body


def _bearer(scope: dict) -> bytes | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            token = token.strip()
            return token if scheme.lower() == b"bearer" and token else None
    return None


__all__ = ["GATED", "GATED_PREFIXES", "Gate", "TokenBuckets"]
