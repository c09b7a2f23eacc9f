"""Admission at the router: at most `max_running` requests run at once and `max_queued` wait, in
arrival order; a full queue is a 429 with Retry-After, a wait past `timeout_s` a 503 (api_respond.respond).
"""

from __future__ import annotations

import asyncio
import time

from splitserve.router.openai_protocol import APIError


class Admission:
    """At most `max_running` requests in flight; at most `max_queued` more waiting, for `timeout_s`."""

    def __init__(self, max_running: int, max_queued: int, timeout_s: float) -> None:
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0
        self.closed = False

    async def acquire(self) -> float:
        """-> seconds waited. Raises APIError 429 (queue full) / 503 (waited too long, or draining)."""
        if self.closed:
            raise APIError(
                503,
                "the server is shutting down",
                type="service_unavailable",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        start = time.perf_counter()
        if self._slots.locked():
            if self.waiting >= self.max_queued:
                raise APIError(
                    429,
                    f"the server is overloaded ({self.running} running, {self.waiting} queued); retry later",
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
            except TimeoutError:
                raise APIError(
                    503,
                    f"no capacity within {self.timeout_s:g}s; retry later",
                    type="service_unavailable",
                    code="queue_timeout",
                    headers={"Retry-After": "2"},
                ) from None
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        self.running += 1
        return time.perf_counter() - start

    def release(self) -> None:
        self.running -= 1
        self._slots.release()
