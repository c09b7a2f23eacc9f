"""A deadline between events that costs a float store per event, for the router's per-token path.

`async with asyncio.timeout(...)` around each awaited line enters a context, makes a timer handle and
cancels it again: about 9 us a token on this project's 2-core CPU, per stream, on the one event loop
that writes every client's tokens (`asyncio.wait_for`, which makes a task as well, about 20 us).
`IdleDeadline` keeps one `asyncio.timeout` context for a whole stream and one timer that re-arms
itself lazily: `touch()` records the time; when the timer comes due it either finds a later touch and
moves itself to that touch's due time, or expires the context (`reschedule` to now), so the awaited
call raises `TimeoutError` from the `async with` as a plain `asyncio.timeout` would.

    async with asyncio.timeout(None) as cm:
        idle = IdleDeadline(cm, first_span_s)
        try:
            while line := await next_line():
                idle.touch(inter_span_s)
                ...
        finally:
            idle.stop()
"""

from __future__ import annotations

import asyncio


class IdleDeadline:
    """Expire `cm` (an entered `asyncio.timeout(None)`) when `span_s` passes without a `touch()`."""

    __slots__ = ("_cm", "_handle", "_loop", "last", "span_s")

    def __init__(self, cm: asyncio.Timeout, span_s: float) -> None:
        self._cm = cm
        self._loop = asyncio.get_running_loop()
        self.span_s = span_s
        self.last = self._loop.time()
        self._handle: asyncio.TimerHandle | None = self._loop.call_at(self.last + span_s, self._due)

    def touch(self, span_s: float | None = None) -> None:
        """An event came: the deadline is now `span_s` (default: the current span) from now."""
        self.last = self._loop.time()
        if span_s is not None and span_s != self.span_s:
            self.span_s = span_s
            self._rearm()  # a shorter span must not wait for the timer armed for the longer one

    def stop(self) -> None:
        if self._handle is not None:
            self._handle.cancel()
            self._handle = None

    def _rearm(self) -> None:
        self.stop()
        self._handle = self._loop.call_at(self.last + self.span_s, self._due)

    def _due(self) -> None:
        self._handle = None
        due = self.last + self.span_s
        if self._loop.time() >= due:
            if self._cm.when() is None:  # never expire it twice
                self._cm.reschedule(self._loop.time())  # now: the awaited call raises TimeoutError
        else:
            self._handle = self._loop.call_at(due, self._due)


__all__ = ["IdleDeadline"]
