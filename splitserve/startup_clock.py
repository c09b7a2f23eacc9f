"""Where a process's start-up went: `mark(phase)` notes the process's age (seconds since the OS started
it, interpreter start-up included) at the end of each phase; `marks()` is what it reports (a worker in
its ready line, the engine core in its health, the router in its ready event), from which `splitserve
serve`'s ready line prints the time each process spent importing, loading its tokenizer, loading
weights and warming up. Linux (/proc); elsewhere the ages are 0."""

from __future__ import annotations

import os

_MARKS: dict[str, float] = {}


def process_age_s() -> float:
    """Seconds since this process started, to the kernel's clock tick (10 ms)."""
    try:
        with open("/proc/self/stat", encoding="ascii") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])  # field 22: starttime
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


def mark(phase: str) -> None:
    """Note that `phase` ended now (the first mark of a phase stands)."""
    _MARKS.setdefault(phase, round(process_age_s(), 3))


def marks() -> dict[str, float]:
    """{phase: the process's age when it ended}, in the order they ended."""
    return dict(_MARKS)


__all__ = ["mark", "marks", "process_age_s"]
