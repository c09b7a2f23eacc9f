"""IdleDeadline (router/idle_deadline.py): the router's deadline between two lines of a worker stream."""

from __future__ import annotations

import asyncio
import time

import pytest

from splitserve.router.idle_deadline import IdleDeadline


async def _lines(gaps: list[float]):
    for gap in gaps:
        await asyncio.sleep(gap)
        yield gap


async def _consume(gaps: list[float], first_s: float, next_s: float) -> tuple[int, float]:
    """-> (lines read before the deadline fired, seconds taken); raises TimeoutError as the router's
    `async with` does."""
    got, t0 = 0, time.perf_counter()
    async with asyncio.timeout(None) as cm:
        idle = IdleDeadline(cm, first_s)
        try:
            async for _ in _lines(gaps):
                idle.touch(next_s)
                got += 1
        finally:
            idle.stop()
    return got, time.perf_counter() - t0


async def test_lines_within_their_spans_never_time_out() -> None:
    # the whole stream outlasts both spans; no gap does
    got, took = await _consume([0.15] + [0.04] * 8, first_s=0.3, next_s=0.1)
    assert got == 9 and took > 0.3


async def test_a_late_first_line_times_out_at_the_first_span() -> None:
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        await _consume([0.5], first_s=0.1, next_s=10)
    assert 0.08 < time.perf_counter() - t0 < 0.4


async def test_a_stall_after_some_lines_times_out_at_the_shorter_next_span() -> None:
    # the first span is long; once a line came the shorter span rules, not the timer armed for the first
    t0 = time.perf_counter()
    with pytest.raises(TimeoutError):
        await _consume([0.01, 0.01, 5.0], first_s=5.0, next_s=0.1)
    assert time.perf_counter() - t0 < 1.0


async def test_stop_leaves_nothing_armed() -> None:
    async with asyncio.timeout(None) as cm:
        idle = IdleDeadline(cm, 0.05)
        idle.stop()
        await asyncio.sleep(0.15)  # would have expired the context
    assert not cm.expired()
