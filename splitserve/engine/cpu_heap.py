"""CPU: keep freed memory in the process, so that a step's temporaries do not fault in fresh pages.

A CPU step allocates large temporaries: a 2,048-token prefill step makes each layer's QKV (7.5 MB),
gate/up (24 MB) and activation (12 MB) outputs, a decode step at batch 64 its logits (12 MB). glibc's
malloc serves such sizes from fresh `mmap`s (its threshold starts at 128 KB and moves only as chunks
are freed) and hands freed heap tops back to the kernel (`trim_threshold`), so each new tensor's pages
fault in again on their first write: ~5 us a page on the 2-vCPU VMs of this repo, 40,000-90,000 minor
faults in one 2,048-token prefill step (`resource.getrusage`), ~0.1-0.2 s of its ~2.1 s.

`keep_freed_memory()` fixes glibc's mmap threshold at its maximum (32 MB: smaller blocks come from
the heap and are reused) and turns trimming off. Measured (docs/bench/cpu-engine.md): the faults of a
prefill step fall to ~50 and the step takes 2-4 % less. The cost: the process keeps the high-water
mark of its temporaries (~0.1-0.3 GB for the default model) instead of returning it between steps.
`SPLITSERVE_CPU_KEEP_HEAP=0` turns it off. No-op where the C library is not glibc.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os

log = logging.getLogger(__name__)

ENABLED = os.environ.get("SPLITSERVE_CPU_KEEP_HEAP", "1") != "0"
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's <malloc.h>
MMAP_THRESHOLD = 32 << 20  # glibc's largest (HEAP_MAX_SIZE / 2 on 64-bit)
TRIM_THRESHOLD = 2**31 - 1  # an int: never trim
_done: bool | None = None


def keep_freed_memory() -> bool:
    """Set the process's malloc to keep blocks up to 32 MB for reuse (once); -> whether it applies."""
    global _done
    if _done is not None:
        return _done
    _done = False
    if not ENABLED:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):  # not glibc (musl has no mallopt)
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    mmap_set = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD))
    _done = mmap_set and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    if not _done:
        log.warning("mallopt refused the thresholds; CPU steps' temporaries fault in fresh pages")
    return _done
