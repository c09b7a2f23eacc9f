"""Timelines of GPU transfers, for finding where a fetch's time goes: `SPLITSERVE_KV_TRACE=1`.

`mark(label)` appends (time.perf_counter(), label) to a per-process ring when tracing is on, and is
one branch when it is off. perf_counter is CLOCK_MONOTONIC on Linux, the same clock in every process
of a host, so an exporter's and a fetcher's marks merge into one timeline (bench/kv_transfer_gpu.py
`--trace` prints them). `gpu_mark(label)` also records a CUDA event on the current stream, resolved
to host time by `events()` later (the GPU's side of the same timeline, e.g. when a send finished).
"""

from __future__ import annotations

import os
import time
from collections import deque

import torch

ON = os.environ.get("SPLITSERVE_KV_TRACE", "") not in ("", "0")
_MARKS: deque[tuple[float, str]] = deque(maxlen=8192)
_EVENTS: deque[tuple[str, torch.cuda.Event, float, torch.cuda.Event]] = deque(maxlen=1024)
_ANCHORS: dict[int, tuple[torch.cuda.Event, float]] = {}


def mark(label: str) -> None:
    if ON:
        _MARKS.append((time.perf_counter(), label))


def gpu_mark(label: str, device: torch.device) -> None:
    """A CUDA event on `device`'s current stream, timed against an anchor event of that device."""
    if not ON or device.type != "cuda":
        return
    index = device.index or 0
    if index not in _ANCHORS:  # an event whose host time is known: synchronize once, when first used
        anchor = torch.cuda.Event(enable_timing=True)
        anchor.record()
        anchor.synchronize()
        _ANCHORS[index] = (anchor, time.perf_counter())
    event = torch.cuda.Event(enable_timing=True)
    event.record()
    anchor, at = _ANCHORS[index]
    _EVENTS.append((label, event, at, anchor))


def events() -> list[tuple[float, str]]:
    """Every mark and resolved GPU event so far, in time order; clears them."""
    out = list(_MARKS)
    _MARKS.clear()
    while _EVENTS:
        label, event, at, anchor = _EVENTS.popleft()
        event.synchronize()
        out.append((at + anchor.elapsed_time(event) / 1e3, f"gpu:{label}"))
    return sorted(out)
