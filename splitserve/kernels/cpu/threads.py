"""A hook at checkpoints of a forward pass, through which a serving loop may change the number of threads
the rest of the step runs on (core/share.py: CPU workers that lend each other idle cores).

A CPU prefill step can take seconds: checked only between steps, a worker that borrowed a core would
keep it that long after its owner wants it back, both then sharing it (measured: a burst's prefill three
times slower). So the hook runs at the start of every layer, and in a CPU prompt step's layer
(model/decoder.py's fused path) also before each of its MLP's two products, most of that layer's time:
a borrowed core comes back, and a lent one is taken up, within one product's time rather than one
layer's (docs/bench/cpu-engine.md: a 1 prefill + 1 decode burst 1.09-1.29x faster in
three alternating pairs)."""

from __future__ import annotations

from collections.abc import Callable

_hook: Callable[[], None] | None = None


def set_hook(fn: Callable[[], None] | None) -> None:
    """`fn` runs at each checkpoint of every forward pass in this process (None: nothing runs)."""
    global _hook
    _hook = fn


def checkpoint() -> None:
    if _hook is not None:
        _hook()


__all__ = ["checkpoint", "set_hook"]
