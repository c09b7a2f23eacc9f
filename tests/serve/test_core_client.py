"""The engine-core channel's socket folders: a front end that died without cleaning up (SIGKILL)
leaves one, and the next front end to start sweeps it; a live process's folder stays."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from splitserve.serve.core_client import _sweep_stale


def test_stale_socket_folders_are_swept() -> None:
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    root = Path(tempfile.gettempdir())
    stale = root / f"splitserve-core-{dead.pid}-test"
    live = root / f"splitserve-core-{os.getpid()}-test"
    for d in (stale, live):
        d.mkdir(exist_ok=True)
        (d / "commands").write_text("")
    try:
        _sweep_stale()
        assert not stale.exists()
        assert live.exists()
    finally:
        for d in (stale, live):
            if d.exists():
                (d / "commands").unlink()
                d.rmdir()
