"""The local runtime's warm spare comes back: kill -9 the standby worker process three times in a row;
each time a new one is spawned within the restart backoff (the first at once) and says it is ready, and
the dead one's engine-core socket folder is swept; at a graceful stop none is left behind."""

from __future__ import annotations

import asyncio
import glob
import os
import signal
import tempfile
import time

from splitserve.config.manifest import load_manifest
from splitserve.runtime.local import LocalRuntime
from splitserve.tempdirs import CORE_SOCKETS


def _folders(pid: int) -> list[str]:
    return glob.glob(os.path.join(tempfile.gettempdir(), f"{CORE_SOCKETS}{pid}-*"))


def test_a_killed_standby_is_replaced_within_the_backoff():
    manifest = load_manifest(None, {
        "mode": "colocated", "model.source": "random:tiny-chat", "model.max_model_len": 256,
        "engine.kv_cache_mb": 8, "runtime.standby": True, "runtime.warm_up": False,
        "runtime.restart_backoff_s": 1.0, "runtime.restart_backoff_max_s": 4.0,
    })  # fmt: skip
    backoff = manifest.runtime.restart_backoff_s

    async def main() -> list[tuple[float, float]]:
        rt = LocalRuntime(manifest)
        await rt.start(progress=False)
        rt.start_standby()  # `splitserve serve` starts it a little after ready
        timings = []
        try:
            for round_ in range(3):
                old = await _wait_for_spare(rt, None, 300)
                made = time.monotonic() + 10
                while not _folders(old.pid) and time.monotonic() < made:
                    await asyncio.sleep(0.05)  # its engine core up, its socket folder made
                assert _folders(old.pid)
                t0 = time.monotonic()
                os.kill(old.pid, signal.SIGKILL)
                spawned = await _wait_for_spare(rt, old, 300, spawned_only=True)
                spawn_s = time.monotonic() - t0
                await _wait_for_spare(rt, old, 300)
                allowed = 0.0 if round_ == 0 else backoff * 2 ** (round_ - 1)
                assert spawn_s < allowed + 5.0, (round_, spawn_s)  # + the spawn's own start
                timings.append((spawn_s, time.monotonic() - t0))
                assert spawned.pid != old.pid and not _folders(old.pid)  # swept once its core went
            spare = rt._standby.proc.pid
        finally:
            await rt.stop()
        assert not _folders(spare)
        return timings

    print(asyncio.run(main()))


async def _wait_for_spare(rt: LocalRuntime, old, timeout_s: float, spawned_only: bool = False):
    """The standby process other than `old`: once spawned (`spawned_only`), else once it is ready."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        spare = rt._standby
        if spare is not None and spare.proc is not old and spare.proc.returncode is None:
            return spare.proc
        if spawned_only:
            newest = _newest_standby(old)
            if newest is not None:
                return newest
        await asyncio.sleep(0.05)
    raise AssertionError("no standby in time")


def _newest_standby(old):
    """A child of this process, other than `old`, running a standby worker (still starting, maybe)."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == old.pid:
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                ppid = int(f.read().rpartition(")")[2].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                cmd = f.read().split(b"\0")
        except (OSError, ValueError, IndexError):
            continue
        if ppid == os.getpid() and b"--standby" in cmd:
            return type("Spawned", (), {"pid": int(entry)})()
    return None
