"""Socket folders named by their owner's pid (the engine-core channel's, the shm and cuda_ipc KV
transports'): a process that died without cleaning up (SIGKILL) leaves one, and the next process to make
one of the same kind sweeps it; a live process's folder stays."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from splitserve.tempdirs import owned_tempdir


@pytest.mark.parametrize("prefix", ["splitserve-core-", "splitserve-kv-"])
def test_stale_socket_folders_are_swept(prefix: str) -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = Path(tempfile.gettempdir())
    stale = root / f"{prefix}{dead.pid}-test"
    live = root / f"{prefix}{os.getpid()}-test"
    for d in (stale, live):
        d.mkdir(exist_ok=True)
        (d / "commands").write_text("")
    try:
        fresh = owned_tempdir(prefix)
        assert not stale.exists()
        assert live.exists() and Path(fresh).name.startswith(f"{prefix}{os.getpid()}-")
        os.rmdir(fresh)
    finally:
        for d in (stale, live):
            if d.exists():
                (d / "commands").unlink()
                d.rmdir()
