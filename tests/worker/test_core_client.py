"""Socket folders named by their owner's pid (the engine-core channel's, the shm and cuda_ipc KV
transports'): a process that died without cleaning up (SIGKILL) leaves one, and the next process to make
one of the same kind sweeps it; a live process's folder stays."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from splitserve.tempdirs import owned_tempdir, remove_if_orphaned, sweep_stale


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


def test_a_stopped_core_is_seen() -> None:
    """A SIGSTOPped engine core answers nothing; its front end reads the core's state and answers
    /health with 503 (engine_stopped), so that the runtime replaces it instead of seeing "ok"."""
    import signal
    import time

    from splitserve.worker.core_client import CoreClient

    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    client = CoreClient.__new__(CoreClient)  # stopped() reads only the process
    client.proc = proc
    try:
        assert not client.stopped()
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while not client.stopped():
            assert time.monotonic() < deadline
            time.sleep(0.05)
        proc.send_signal(signal.SIGCONT)
        while client.stopped():
            assert time.monotonic() < deadline + 5
            time.sleep(0.05)
    finally:
        proc.kill()
        proc.wait()


def test_a_dead_or_zombie_owners_folder_is_removed_and_a_live_ones_kept() -> None:
    """A worker whose runtime was SIGKILLed removes the runtime's folder of lent cores on its way out
    (`remove_if_orphaned`; the full chaos suite's "kill -9 router" found it left behind). The runtime
    may not be reaped yet when its workers go: a zombie counts as gone, for the sweep too."""
    prefix = "splitserve-cores-"
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # exits; not reaped until wait()
    deadline = time.monotonic() + 10
    while Path(f"/proc/{zombie.pid}/stat").read_text().rsplit(")", 1)[-1].split()[0] != "Z":
        assert time.monotonic() < deadline
        time.sleep(0.02)
    root = Path(tempfile.gettempdir())
    live, dead, swept = (root / f"{prefix}{os.getpid()}-test", root / f"{prefix}{zombie.pid}-test",
                         root / f"splitserve-kv-{zombie.pid}-test")  # fmt: skip
    try:
        for d in (live, dead, swept):
            d.mkdir(exist_ok=True)
        assert not remove_if_orphaned(str(live), prefix) and live.exists()
        assert remove_if_orphaned(str(dead), prefix) and not dead.exists()
        assert not remove_if_orphaned(str(swept), prefix)  # not a folder of that kind
        sweep_stale("splitserve-kv-")
        assert not swept.exists()
    finally:
        zombie.wait()
        for d in (live, dead, swept):
            if d.exists():
                d.rmdir()
