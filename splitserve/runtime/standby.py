"""The local runtime's warm spare: one worker process that has done its imports (its engine core too)
and waits on stdin for the command line of the worker it will become (`python -m splitserve.worker.main
--standby`). `spawn_standby` starts one and waits for its "standby" line; `LocalRuntime._keep_standby`
keeps one alive: a new one once a restart has taken it, and a replacement when it dies unused (at
once the first time, then after the restart backoff, doubled per death in a row), the dead one's
engine-core socket folder swept."""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import json
import logging
import signal
import sys
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

log = logging.getLogger(__name__)


@dataclass
class Standby:
    proc: asyncio.subprocess.Process
    owner: Any = None  # the WorkerProcess it became (its stderr lines are then that worker's)


def die_with_parent() -> None:  # runs in the child between fork and exec
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


async def spawn_standby(
    env: dict[str, str], forward: Callable[[Standby, asyncio.subprocess.Process], Coroutine[Any, Any, None]]
) -> Standby | None:
    """A spare worker process once it says it is ready to become one; None (logged) if it did not."""
    argv = [sys.executable, "-m", "splitserve.worker.main", "--standby"]
    proc = await asyncio.create_subprocess_exec(
        *argv,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        preexec_fn=die_with_parent,
        start_new_session=True,
    )
    spare = Standby(proc)
    asyncio.create_task(forward(spare, proc))
    assert proc.stdout is not None
    try:
        line = await asyncio.wait_for(proc.stdout.readline(), 300)
        if json.loads(line or b"{}").get("event") != "standby":
            raise ValueError(f"unexpected first line {line[:100]!r}")
    except (TimeoutError, ValueError) as exc:
        log.warning("the standby worker process did not start (%s); restarts spawn afresh", exc)
        await kill(proc)
        return None
    return spare


async def taken_or_dead(spare: Standby, taken: asyncio.Event) -> int | None:
    """Wait until a restart takes `spare` (-> None) or it exits unused (-> its exit code)."""
    died = asyncio.ensure_future(spare.proc.wait())
    took = asyncio.ensure_future(taken.wait())
    try:
        await asyncio.wait({died, took}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        died.cancel()
        took.cancel()
    return None if taken.is_set() else spare.proc.returncode


async def kill(proc: asyncio.subprocess.Process, grace_s: float = 5.0) -> int | None:
    if proc.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            proc.terminate()
        try:
            await asyncio.wait_for(proc.wait(), grace_s)
        except TimeoutError:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            await proc.wait()
    return proc.returncode


__all__ = ["Standby", "die_with_parent", "kill", "spawn_standby", "taken_or_dead"]
