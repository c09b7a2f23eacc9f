"""Temporary folders named by their owner's pid, so that what a SIGKILLed process leaves behind is
swept by the next process that makes one of the same kind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable


def owned_tempdir(prefix: str, before_removal: Callable[[str], None] | None = None) -> str:
    """A fresh 0700 folder `<tmp>/<prefix><pid>-XXXX`, after removing every `<prefix><pid>-*` folder
    whose process is gone (`before_removal(path)` is called first, for what must be shut down before
    its folder goes: an orphaned daemon listening there, say)."""
    sweep_stale(prefix, before_removal)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def sweep_stale(prefix: str, before_removal: Callable[[str], None] | None = None) -> None:
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        if not name.startswith(prefix):
            continue
        pid = name[len(prefix) :].split("-", 1)[0]
        if not pid.isdigit():
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            path = os.path.join(root, name)
            if before_removal is not None:
                before_removal(path)
            shutil.rmtree(path, ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


__all__ = ["owned_tempdir", "sweep_stale"]
