"""The event loop a splitserve process runs its asyncio code on: uvloop where it is installed (a
dependency on Linux and macOS), else asyncio's own; `SPLITSERVE_EVENT_LOOP=asyncio` picks asyncio's
(as uvicorn's `--loop asyncio` does). A streamed token crosses the router's loop, so each of its
wake-ups and socket writes is on the path of every request's latency."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

T = TypeVar("T")


def loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's loop constructor, or None (asyncio's default) where uvloop is missing or not wanted."""
    if os.environ.get("SPLITSERVE_EVENT_LOOP", "auto") == "asyncio":
        return None
    try:
        import uvloop
    except ImportError:
        return None
    return uvloop.new_event_loop


def run(main: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(main)` on the loop `loop_factory` picks."""
    with asyncio.Runner(loop_factory=loop_factory()) as runner:
        return runner.run(main)


__all__ = ["loop_factory", "run"]
