"""Programmatic dependent launch (PDL): a kernel starts while the one before it in the stream ends.

Batch-1 decode is ~300 small kernels a step (~4 ms on an H200), and each waits for the previous one
to drain and for its own launch before it reads a byte. Launched with PDL (compute capability 9.0
and later; captured into CUDA graphs as programmatic edges), a kernel's programs are placed on the
SMs as soon as every program of the previous kernel has signalled `griddepcontrol.launch_dependents`
(ours do at their start), and each waits on the device (`griddepcontrol.wait`) until the previous
kernel has finished and its writes are visible. Work that reads nothing a kernel of the step writes
may come before the wait: kernels/gemv.py reads its first weight tile and the next norm's weight
there; with `EARLY` (`begin_early` / `end_early`), kernels/paged_attention.py's decode reads its
first tile of earlier tokens' K/V (the step's own token, which an earlier kernel of the step
stores, after the wait) and kernels/fused.py's q/k kernel its cos/sin and norm weights. The step's
inputs (positions, slots, block tables, context lengths) are copied in before its first kernel, so
they are safe too.

NOTE: the wait must run in every program of every kernel launched with PDL, before it reads or writes
anything an earlier kernel touches. A kernel that ends without waiting could end before its own
predecessor, and the next kernel's wait would then cover neither. `begin(PDL)` at a kernel's top
does both. Kernels launched without PDL (torch's, and ours when off) wait for everything before them.

`SPLITSERVE_PDL=0` turns it off (read at launch; decode graphs bake it in at capture).
"""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

ENABLED = os.environ.get("SPLITSERVE_PDL", "1") != "0"
# Reads before the wait of what no kernel of the step writes, beyond a GEMV's weights (norm weights
# and cos/sin of the q/k kernel, block tables and earlier tokens' K/V of decode attention);
# `SPLITSERVE_PDL_EARLY=0` reads them after the wait (read at import: an A/B switch)
EARLY = os.environ.get("SPLITSERVE_PDL_EARLY", "1") != "0"


def on(device: torch.device) -> bool:
    """Launch kernels on `device` with PDL: enabled, a CUDA device of compute capability >= 9.0, and
    not under Triton's interpreter."""
    return ENABLED and device.type == "cuda" and _hopper_or_later(device.index)


@functools.cache
def _hopper_or_later(device: int | None) -> bool:
    if os.environ.get("TRITON_INTERPRET", "0") == "1":
        return False
    return torch.cuda.get_device_capability(device)[0] >= 9


@triton.jit
def begin(PDL: tl.constexpr):
    """At a kernel's top: let the next kernel launch, then wait for the previous one's writes."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        tl.extra.cuda.gdc_wait()


@triton.jit
def begin_early(PDL: tl.constexpr, EARLY: tl.constexpr):
    """At the top of a kernel that reads early: let the next kernel launch; wait here only if not
    EARLY (then the early reads come after the wait), else at `end_early`."""
    if PDL:
        tl.extra.cuda.gdc_launch_dependents()
        if not EARLY:
            tl.extra.cuda.gdc_wait()


@triton.jit
def end_early(PDL: tl.constexpr, EARLY: tl.constexpr):
    """After the early reads: the wait `begin_early` left out."""
    if PDL and EARLY:
        tl.extra.cuda.gdc_wait()


__all__ = ["EARLY", "ENABLED", "begin", "begin_early", "end_early", "on"]
