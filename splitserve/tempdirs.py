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
        if pid.isdigit() and _gone(int(pid)):
            path = os.path.join(root, name)
            if before_removal is not None:
                before_removal(path)
            shutil.rmtree(path, ignore_errors=True)


def remove_if_orphaned(path: str, prefix: str) -> bool:
    """Remove `path`, an `owned_tempdir(prefix)` folder of another process, if that process is gone
    (a worker whose runtime was SIGKILLed removes the runtime's folder on its way out); -> removed."""
    name = os.path.basename(os.path.normpath(path))
    pid = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
    if not pid.isdigit() or not _gone(int(pid)):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie its parent has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's live process
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[-1].split()[:1] == ["Z"]
    except OSError:
        return False


__all__ = ["owned_tempdir", "remove_if_orphaned", "sweep_stale"]
