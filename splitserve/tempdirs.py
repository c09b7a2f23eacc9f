"""Temporary folders named by their owner's pid, so that what a SIGKILLed process leaves behind is
swept by the next process that makes one of the same kind."""

from __future__ import annotations

import os
import shutil
import tempfile


def owned_tempdir(prefix: str) -> str:
    """A fresh 0700 folder `<tmp>/<prefix><pid>-XXXX`, after removing every `<prefix><pid>-*` folder
    whose process is gone."""
    sweep_stale(prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")


def sweep_stale(prefix: str) -> None:
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
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)
        except PermissionError:
            pass  # another user's live process


__all__ = ["owned_tempdir", "sweep_stale"]
