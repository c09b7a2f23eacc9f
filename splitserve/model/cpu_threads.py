"""A hook between the layers of a forward pass, through which a serving loop may change the number of
threads the rest of the step runs on (serve/core_share.py: CPU workers that lend each other idle
cores). A CPU prefill step can take seconds: checked only between steps, a worker that borrowed a core
would keep it that long after its owner wants it back, both then sharing it (measured: a burst's
prefill three times slower). Between layers, the core comes back within one layer's time."""

from __future__ import annotations

from collections.abc import Callable

_hook: Callable[[], None] | None = None


def set_layer_hook(fn: Callable[[], None] | None) -> None:
    """`fn` runs before each layer of every forward pass in this process (None: nothing runs)."""
    global _hook
    _hook = fn


def between_layers() -> None:
    if _hook is not None:
        _hook()


__all__ = ["between_layers", "set_layer_hook"]
