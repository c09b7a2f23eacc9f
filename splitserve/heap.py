"""Keep the garbage collector's full passes off the serving path.

After start-up a serving process holds a large, long-lived object graph (the model's modules, the
engine, the web stack) that every full (generation 2) collection walks again; under load such a pass
stalls the loop for tens to hundreds of milliseconds at an unpredictable step. `freeze_heap()` collects
once and moves everything alive into the permanent generation, which later collections skip (as
vLLM's engine does after start-up); objects made while serving are collected as usual.
"""

from __future__ import annotations

import gc
import logging
import time

log = logging.getLogger(__name__)


def freeze_heap(what: str) -> None:
    t0 = time.perf_counter()
    gc.collect()
    gc.freeze()
    log.info("%s: %d objects frozen out of the collector in %.0f ms", what, gc.get_freeze_count(),
             1e3 * (time.perf_counter() - t0))  # fmt: skip


__all__ = ["freeze_heap"]
