"""CUDA MPS for workers that share a GPU (runtime/mps.py): when the local runtime starts a daemon, what
its workers are given, and that it is told to quit.

No GPU and no NVIDIA driver here, so `nvidia-cuda-mps-control` is a STAND-IN: a shell script put first
on PATH that records how it was called (arguments, its pipe folder, what came on stdin). The real
daemon was run on the H200 (docs/bench/served-path.md)."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from splitserve.config.manifest import parse_manifest
from splitserve.runtime.local import LocalRuntime, StartupError
from splitserve.runtime.mps import PIPE_ENV, MpsDaemon, plan, shared_gpus

ONE_GPU_PD = """
model: {source: random:tiny, device: cuda}
mode: disaggregated
prefill: {devices: ["cuda:0"]}
decode: {devices: ["cuda:0"]}
"""
TWO_GPU_PD = ONE_GPU_PD.replace('decode: {devices: ["cuda:0"]}', 'decode: {devices: ["cuda:1"]}')


def _manifest(text: str, mode: str = "auto"):
    return parse_manifest(text, overrides={"runtime.cuda_mps": mode})


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in nvidia-cuda-mps-control first on PATH; -> the file it appends its calls to."""
    calls = tmp_path / "calls.txt"
    bindir = tmp_path / "bin"
    bindir.mkdir()
    script = bindir / "nvidia-cuda-mps-control"
    script.write_text(
        "#!/bin/sh\n"
        f'echo "args=$* pipe=$CUDA_MPS_PIPE_DIRECTORY log=$CUDA_MPS_LOG_DIRECTORY" >> {calls}\n'
        f'[ "$1" = -d ] || {{ read cmd; echo "stdin=$cmd" >> {calls}; }}\n'
    )
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.delenv(PIPE_ENV, raising=False)
    return calls


def test_which_gpus_are_shared() -> None:
    assert shared_gpus(_manifest(ONE_GPU_PD)) == ["cuda:0"]
    assert shared_gpus(_manifest(TWO_GPU_PD)) == []
    assert shared_gpus(parse_manifest("model: {source: random:tiny, device: cpu}")) == []
    # two colocated replicas on the one default device share it
    two = "model: {source: random:tiny, device: cuda}\nmode: colocated\ncolocated: {replicas: 2}\n"
    assert shared_gpus(_manifest(two)) == ["cuda:0"]


def test_plan_by_mode_and_host(stand_in: Path) -> None:
    assert plan(_manifest(ONE_GPU_PD)).start
    assert not plan(_manifest(ONE_GPU_PD, "off")).start
    assert not plan(_manifest(TWO_GPU_PD)).start
    # an operator's own daemon is used as it is
    own = plan(_manifest(ONE_GPU_PD, "on"), {**os.environ, PIPE_ENV: "/run/mps"})
    assert not own.start and "/run/mps" in own.why
    with pytest.raises(RuntimeError, match="no two workers share"):
        plan(_manifest(TWO_GPU_PD, "on"))
    # the default deployment (device auto) on this host without a GPU: nothing to share
    default = plan(parse_manifest(""))
    assert not default.start and default.devices == []


def test_without_the_binary_auto_runs_without_and_on_refuses(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.delenv(PIPE_ENV, raising=False)
    quiet = plan(_manifest(ONE_GPU_PD))
    assert not quiet.start and "not on PATH" in quiet.why
    runtime = LocalRuntime(_manifest(ONE_GPU_PD, "on"))
    with pytest.raises(StartupError, match="nvidia-cuda-mps-control is not on PATH"):
        runtime._start_mps()


async def test_the_runtime_starts_a_private_daemon_and_quits_it(stand_in: Path) -> None:
    runtime = LocalRuntime(_manifest(ONE_GPU_PD))
    runtime._start_mps()  # what start() does before it spawns the workers
    pipe = runtime.env[PIPE_ENV]
    assert Path(pipe).is_dir() and all(w.env[PIPE_ENV] == pipe for w in runtime.workers)
    assert runtime.mps_state() == {"on": True, "devices": ["cuda:0"], "why": "workers share cuda:0"}
    await runtime.stop()
    calls = stand_in.read_text().splitlines()
    assert calls[0].startswith(f"args=-d pipe={pipe} log=")
    assert calls[1].startswith(f"args= pipe={pipe}") and calls[2] == "stdin=quit"
    assert not Path(pipe).exists()  # its folders are gone with it


def test_a_daemon_left_by_a_killed_runtime_is_told_to_quit_before_its_folder_goes(
    stand_in: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import subprocess
    import sys
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True)
    left = tmp_path / f"splitserve-mps-{int(gone.stdout)}-abcd"  # what a SIGKILLed runtime leaves
    (left / "pipe").mkdir(parents=True)
    (left / "log").mkdir()
    daemon = MpsDaemon()
    daemon.start()
    calls = stand_in.read_text().splitlines()
    assert calls[0] == f"args= pipe={left / 'pipe'} log={left / 'log'}" and calls[1] == "stdin=quit"
    assert calls[2].startswith("args=-d pipe=") and not left.exists()
    daemon.stop()
