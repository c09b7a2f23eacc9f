"""Workers pinned to cores of their own (`runtime.pin_cores`): the local runtime splits the host's
CPUs evenly among its CPU workers (`split_cpus`), and each worker's front end and engine core bind
every thread they have to their share (`pin`), with torch running one intra-op thread per CPU given.

Pinned workers share no compute, so a step's time is what a profile timed on as many cores of its
own says (splitserve/plan), whatever the other workers do, except for the memory bus they still share
(plan/corun.py measures that). The router and a load client on the same host are not pinned and run
on whichever core is free. Pinning replaces core lending (share.py): a pinned worker cannot run on a
core it does not own.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence


def host_cpus() -> list[int]:
    """The CPUs this process may run on, in order (the host's, less any the caller was fenced from)."""
    return sorted(os.sched_getaffinity(0))


def split_cpus(cpus: Sequence[int], workers: int) -> list[tuple[int, ...]]:
    """`cpus` split into `workers` disjoint, contiguous, equal shares (the remainder unused); with
    fewer CPUs than workers, worker i gets CPU i mod len(cpus) and some share one."""
    cpus = list(cpus)
    if workers < 1 or not cpus:
        return []
    if len(cpus) < workers:
        return [(cpus[i % len(cpus)],) for i in range(workers)]
    each = len(cpus) // workers
    return [tuple(cpus[i * each : (i + 1) * each]) for i in range(workers)]


def pin(cpus: Sequence[int]) -> None:
    """Bind every thread of this process to `cpus` (threads started later inherit it). Linux sets
    affinity per thread, so each one the process already has (a lifeline, ZMQ's) is bound by id."""
    if not cpus:
        return
    mask = set(cpus)
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        tids = [0]
    for tid in tids:
        with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
            os.sched_setaffinity(tid, mask)


__all__ = ["host_cpus", "pin", "split_cpus"]
