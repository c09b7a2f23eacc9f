"""Temporary folders named by their owner's pid, so that what a SIGKILLed process leaves behind is
swept by the next process that makes one of the same kind."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Callable

CORE_SOCKETS = "splitserve-core-"  # a worker front end's folder of its engine core's sockets


def owned_tempdir(prefix: str, before_removal: Callable[[str], None] | None = None) -> str:
    """A fresh 0700 folder `<tmp>/<prefix><pid>-XXXX`, after removing every `<prefix><pid>-*` folder
    whose process is gone (`before_removal(path)` is called first, for what must be shut down before
    its folder goes: an orphaned daemon listening there, say)."""
    sweep_stale(prefix, before_removal)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def sweep_stale(prefix: str, before_removal: Callable[[str], None] | None = None) -> None:
    root = tempfile.gettempdir()
    for name in os.listdir(root):
        pid = _owner(name, prefix)
        if pid is not None and process_gone(pid):
            path = os.path.join(root, name)
            if before_removal is not None:
                before_removal(path)
            shutil.rmtree(path, ignore_errors=True)


def remove_if_orphaned(path: str, prefix: str) -> bool:
    """Remove `path`, an `owned_tempdir(prefix)` folder of another process, if that process is gone
    (a worker whose runtime was SIGKILLed removes the runtime's folder on its way out); -> removed."""
    pid = _owner(os.path.basename(os.path.normpath(path)), prefix)
    if pid is None or not process_gone(pid):
        return False
    shutil.rmtree(path, ignore_errors=True)
    return True


def _owner(name: str, prefix: str) -> int | None:
    """The owner's pid of a folder named `<prefix><pid>-XXXX`; None for any other name."""
    pid = name[len(prefix) :].split("-", 1)[0] if name.startswith(prefix) else ""
    return int(pid) if pid.isdigit() else None


def process_gone(pid: int) -> bool:
    """The process has exited: no such pid, or a zombie its parent has not reaped yet."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False  # another user's live process
    return process_state(pid) == "Z"


def process_state(pid: int) -> str | None:
    """/proc/PID/stat's state letter ("R", "S", "T" stopped, "Z" zombie, ...); None if unreadable."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[-1].split()  # after the command name, which may hold ")"
    except OSError:
        return None
    return fields[0] if fields else None


__all__ = [
    "CORE_SOCKETS",
    "owned_tempdir",
    "process_gone",
    "process_state",
    "remove_if_orphaned",
    "sweep_stale",
]
