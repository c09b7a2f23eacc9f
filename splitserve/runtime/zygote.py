"""The local runtime's engine-core fork server (core/zygote.py): started first, so that torch and the
engine are imported once, while the router imports its own modules, and every engine core (each
worker's, the warm spare's, a restart's) is a fork of it instead of a fresh interpreter.

`start_zygote(env)` makes a private folder with a listening Unix socket, spawns `python -m
splitserve.core.zygote FD FOLDER` with it (PR_SET_PDEATHSIG: it dies with this process, and removes the
folder then) and returns the handle; the front ends find the socket through `$SPLITSERVE_CORE_ZYGOTE` in their
environment (`Zygote.env`). CPU deployments only: a process that forks must not have made a CUDA
context, and a GPU core's start is its context and weights, not its imports. `SPLITSERVE_CORE_FORK=0`
turns it off (every core then imports on its own, as on a GPU host).
This module imports nothing heavy: `splitserve serve` calls it before the router's own imports."""

from __future__ import annotations

import glob
import io
import os
import shutil
import socket
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

from splitserve.runtime.standby import die_with_parent
from splitserve.tempdirs import owned_tempdir
from splitserve.wire.lifecycle import ZYGOTE_ENV

FOLDER = "splitserve-zygote-"


@dataclass
class Zygote:
    proc: subprocess.Popen
    folder: str

    @property
    def env(self) -> dict[str, str]:
        return {ZYGOTE_ENV: os.path.join(self.folder, "fork.sock")}

    def stop(self, grace_s: float = 5.0) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(grace_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        shutil.rmtree(self.folder, ignore_errors=True)


def wanted(manifest: Any, env: dict[str, str] | None = None) -> bool:
    """Whether this deployment's cores come from a fork server: on the CPU (`model.device` cpu, or auto
    on a host without NVIDIA devices), unless SPLITSERVE_CORE_FORK=0."""
    if (env if env is not None else os.environ).get("SPLITSERVE_CORE_FORK", "1") == "0":
        return False
    if manifest.runtime.kind != "local":
        return False
    device = manifest.model.device
    return device == "cpu" or (device == "auto" and not glob.glob("/dev/nvidia[0-9]*"))


def early(argv: list[str]) -> Zygote | None:
    """For `splitserve serve ARGS` (`argv`): the fork server, started before the command line is parsed
    and the manifest read (~0.4 s), where it will most likely be wanted: a host without NVIDIA devices,
    not switched off, and not a command that only prints. `wanted(manifest)` decides once the manifest
    is read (a Ray deployment stops it)."""
    quick = {"--print-manifest", "--help", "-h", "--version"}
    if argv[:1] != ["serve"] or quick & set(argv) or os.environ.get("SPLITSERVE_CORE_FORK", "1") == "0":
        return None
    if glob.glob("/dev/nvidia[0-9]*"):
        return None
    return start_zygote(dict(os.environ))


def _stderr_fd() -> int | None:
    """Our stderr's descriptor for the server's stdout (None: inherit ours, where stderr is no file)."""
    try:
        return sys.stderr.fileno()
    except (AttributeError, ValueError, io.UnsupportedOperation):
        return None


def start_zygote(env: dict[str, str]) -> Zygote:
    """Spawn the fork server; it answers its first request once its imports are done (the socket
    listens from now on: a front end that asks earlier waits in the backlog)."""
    folder = owned_tempdir(FOLDER)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        listener.bind(os.path.join(folder, "fork.sock"))
        listener.listen(64)
        proc = subprocess.Popen(
            [sys.executable, "-m", "splitserve.core.zygote", str(listener.fileno()), folder],
            env={**env, "PYTHONUNBUFFERED": "1"}, stdin=subprocess.DEVNULL, stdout=_stderr_fd(),
            pass_fds=(listener.fileno(),), preexec_fn=die_with_parent, start_new_session=True,
        )  # fmt: skip
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    finally:
        listener.close()  # the server's copy stays: once it is gone, a connect is refused at once
    return Zygote(proc, folder)


__all__ = ["ZYGOTE_ENV", "Zygote", "early", "start_zygote", "wanted"]
