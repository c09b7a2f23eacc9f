"""Keep the garbage collector's full passes off the serving path.

After start-up a serving process holds a large, long-lived object graph (the model's modules, the
engine, the web stack) that every full (generation 2) collection walks again; under load such a pass
stalls the loop for tens to hundreds of milliseconds at an unpredictable step. `freeze_heap()` collects
once and moves everything alive into the permanent generation, which later collections skip (as
vLLM's engine does after start-up); objects made while serving are collected as usual.

`pause_collector()` at a process's start: imports make many objects and few cycles, and the passes the
collector makes over the growing heap of modules meanwhile cost a start 0.1-0.3 s of CPU (torch's
imports in the engine cores' fork server: 1.58 s with them, 1.28-1.47 s without, on the 2-core host);
`freeze_heap()` turns it back on, after its one pass.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def pause_collector() -> None:
    """No collections until `freeze_heap()` (or `gc.enable()`)."""
    gc.disable()


def freeze_heap(what: str) -> None:
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    gc.enable()
    log.info("%s: %d objects frozen out of the collector in %.0f ms", what, gc.get_freeze_count(),
             1e3 * (time.perf_counter() - t0))  # fmt: skip


__all__ = ["freeze_heap", "pause_collector"]
