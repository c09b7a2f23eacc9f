"""CUDA MPS for workers that share a GPU (the local runtime).

Two worker processes on one GPU (a prefill worker and a decode worker on cuda:0, say) each hold their
own CUDA context. Without MPS the GPU time-slices between contexts: a decode step never runs beside a
prefill chunk, and each of the decode worker's small steps waits its turn and then reads every weight
alone. With NVIDIA's Multi-Process Service the two processes' kernels share the GPU at once, as two
streams of one process would. Measured on one H200 (Qwen3-8B shape, 128 x (512 in, 128 out), the
workers over `cuda_ipc`; docs/bench/served-path.md): disaggregated 4,223 output tok/s without MPS
(0.75x colocated), 5,477 with it (0.96x colocated); colocated is the same either way.

`runtime.cuda_mps`:
  * `auto` (default): start a private MPS control daemon for this deployment when two or more of its
    workers are placed on one CUDA device and `nvidia-cuda-mps-control` is on PATH; otherwise run
    without it and say why in the log. An operator's own MPS (`CUDA_MPS_PIPE_DIRECTORY` already set) is
    used as it is, never a second one started.
  * `on`: the same, but a deployment that cannot have MPS refuses to start, naming what is missing.
  * `off`: never.
The daemon's pipe and log folders live in a temp folder owned by the runtime (swept when it is gone);
the workers find it through `CUDA_MPS_PIPE_DIRECTORY` in their environment; it is told to quit when
the runtime stops, and a daemon left by a runtime that was SIGKILLed is told to quit by the next
deployment's sweep before its folder is removed.
NOTE: under MPS a fatal GPU fault in one client (an illegal address, say) ends every client on that
GPU: the workers sharing it share its fate, which they do for memory already.
"""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from splitserve.config.manifest import Manifest
from splitserve.runtime.common import pool_device
from splitserve.tempdirs import owned_tempdir

log = logging.getLogger(__name__)

CONTROL = "nvidia-cuda-mps-control"
PIPE_ENV = "CUDA_MPS_PIPE_DIRECTORY"
LOG_ENV = "CUDA_MPS_LOG_DIRECTORY"


def shared_gpus(manifest: Manifest, auto_is_cuda: bool = True) -> list[str]:
    """The CUDA devices that two or more of the deployment's workers resolve to. `cuda` counts as
    cuda:0 (the device a worker takes when given no index), and so does `auto` when `auto_is_cuda`."""
    placed: Counter[str] = Counter()
    for role, pool in manifest.pools().items():
        for i in range(pool.replicas):
            dev = pool_device(manifest, role, i)
            if dev == "cpu" or (dev == "auto" and not auto_is_cuda):
                continue
            placed["cuda:0" if dev in ("cuda", "auto") else dev] += 1
    return sorted(d for d, n in placed.items() if n > 1)


def _cuda_visible() -> bool:
    import torch

    return torch.cuda.is_available()


@dataclass
class MpsPlan:
    """What the runtime does about MPS: `start` a daemon, or not, and `why` (logged, and in the
    deployment's description)."""

    start: bool
    why: str
    devices: list[str] = field(default_factory=list)


def plan(manifest: Manifest, environ: dict[str, str] | None = None) -> MpsPlan:
    """Decide from `runtime.cuda_mps`, the workers' placement and this host; raises RuntimeError when
    `on` cannot be had. A worker on `auto` counts as on the GPU only where the driver utilities are
    installed and torch sees a GPU (so a CPU host says nothing of MPS)."""
    env = os.environ if environ is None else environ
    mode = manifest.runtime.cuda_mps
    if mode == "off":
        return MpsPlan(False, "runtime.cuda_mps is off", shared_gpus(manifest, auto_is_cuda=False))
    control = shutil.which(CONTROL, path=env.get("PATH"))
    devices = shared_gpus(manifest, auto_is_cuda=control is not None and _cuda_visible())
    if env.get(PIPE_ENV):
        return MpsPlan(False, f"using the MPS daemon already named by {PIPE_ENV}={env[PIPE_ENV]}", devices)
    if not devices:
        if mode == "on":
            raise RuntimeError(
                "runtime.cuda_mps is on, but no two workers share a CUDA device (pools' `devices`); "
                "set it to auto or off"
            )
        return MpsPlan(False, "no two workers share a CUDA device", devices)
    if control is None:
        why = f"{CONTROL} is not on PATH (NVIDIA's driver utilities)"
        if mode == "on":
            raise RuntimeError(f"runtime.cuda_mps is on, but {why}; install them or set it to off")
        return MpsPlan(False, why + "; the workers sharing a GPU time-slice it", devices)
    return MpsPlan(True, f"workers share {', '.join(devices)}", devices)


class MpsDaemon:
    """A private MPS control daemon: `start()` -> the environment its clients need; `stop()` quits it
    (its server ends with it) and removes its folders."""

    def __init__(self) -> None:
        self.root: Path | None = None

    def env(self) -> dict[str, str]:
        assert self.root is not None
        return {PIPE_ENV: str(self.root / "pipe"), LOG_ENV: str(self.root / "log")}

    def start(self, timeout_s: float = 10.0) -> dict[str, str]:
        self.root = Path(owned_tempdir("splitserve-mps-", before_removal=_quit_orphan))
        env = self.env()
        for d in env.values():
            Path(d).mkdir(mode=0o700)
        # `-d` forks the daemon and returns at once; a daemon that fails to start says so here
        done = subprocess.run(
            [CONTROL, "-d"], env={**os.environ, **env}, capture_output=True, text=True, timeout=timeout_s
        )
        if done.returncode != 0:
            self._remove()
            said = (done.stderr or done.stdout).strip()
            raise RuntimeError(f"{CONTROL} -d failed ({done.returncode}): {said}")
        log.info("CUDA MPS: started a control daemon for this deployment (%s=%s)", PIPE_ENV, env[PIPE_ENV])
        return env

    def stop(self, timeout_s: float = 10.0) -> None:
        if self.root is None:
            return
        try:
            subprocess.run(
                [CONTROL], input="quit\n", env={**os.environ, **self.env()}, capture_output=True,
                text=True, timeout=timeout_s,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("CUDA MPS: the control daemon did not quit: %s", exc)
        self._remove()

    def _remove(self) -> None:
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
            self.root = None


def _quit_orphan(folder: str, timeout_s: float = 10.0) -> None:
    """The daemon of a runtime that died without stopping it (SIGKILL) outlives it: tell it to quit
    before its pipe folder is swept, or it would run on with no way left to reach it."""
    pipe = Path(folder) / "pipe"
    if not pipe.is_dir() or shutil.which(CONTROL) is None:
        return
    env = {**os.environ, PIPE_ENV: str(pipe), LOG_ENV: str(Path(folder) / "log")}
    try:
        subprocess.run([CONTROL], input="quit\n", env=env, capture_output=True, text=True, timeout=timeout_s)
        log.warning("CUDA MPS: told the control daemon left by a dead runtime (%s) to quit", folder)
    except (OSError, subprocess.TimeoutExpired) as exc:
        log.warning("CUDA MPS: the daemon left in %s did not quit: %s", folder, exc)


__all__ = ["MpsDaemon", "MpsPlan", "plan", "shared_gpus"]
