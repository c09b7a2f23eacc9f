"""Start `splitserve serve` as a child process and wait until it serves (benchmarks, verify, tests)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from splitserve.config.manifest import Manifest


@dataclass
class ServeProcess:
    proc: subprocess.Popen
    url: str = ""  # http://host:port
    ready: dict = field(default_factory=dict)  # the ready event: workers, mode, model
    log: deque[str] = field(default_factory=lambda: deque(maxlen=500))
    tmpdir: Path | None = None  # the manifest's folder, removed when the deployment stops

    def stop(self, timeout_s: float = 60.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.tmpdir is not None:
            shutil.rmtree(self.tmpdir, ignore_errors=True)  # no manifest folder left behind
            self.tmpdir = None
        return self.proc.returncode

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(self, *_: object) -> None:
        self.stop()


def start_serve(
    manifest: Manifest | None,
    timeout_s: float = 600.0,
    echo: bool = False,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> ServeProcess:
    """Write `manifest` to a temp file, run `splitserve serve` on it (its port: as given, 0 = any) and
    return once it prints its ready event. Raises RuntimeError with its output if it does not start.
    `args`: more command-line arguments (with no manifest: all of them, e.g. a model and vLLM's flags);
    `env`: more environment variables."""
    cmd = [sys.executable, "-m", "splitserve.cli", "serve"]
    tmpdir = None
    if manifest is not None:
        tmpdir = Path(tempfile.mkdtemp(prefix="splitserve-"))
        path = tmpdir / "manifest.yaml"
        path.write_text(yaml.safe_dump(manifest.model_dump(mode="json")))
        cmd.append(str(path))
    cmd += [*(args or []), "--no-progress"]
    proc = subprocess.Popen(
        cmd,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
    )
    sp = ServeProcess(proc, tmpdir=tmpdir)
    got = threading.Event()

    def pump(stream: object, is_err: bool) -> None:
        for line in stream:  # type: ignore[attr-defined]
            sp.log.append(line.rstrip())
            if echo:
                print(line, end="", file=sys.stderr)
            if is_err and line.startswith('{"event": "ready"'):
                sp.ready = json.loads(line)
                sp.url = sp.ready["url"]
                got.set()

    threading.Thread(target=pump, args=(proc.stderr, True), daemon=True).start()
    threading.Thread(target=pump, args=(proc.stdout, False), daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not got.wait(0.2):
        if proc.poll() is not None or time.monotonic() > deadline:
            sp.stop(5)
            raise RuntimeError("splitserve serve did not start:\n" + "\n".join(sp.log))
    return sp


__all__ = ["ServeProcess", "start_serve"]
