"""An engine core forked by the fork server (core/zygote.py) instead of spawned as a fresh interpreter:
`fork_core()` asks the server named by `$SPLITSERVE_CORE_ZYGOTE` and returns a `ForkedCore`, which the
core client (core_client.py) uses as it would a `subprocess.Popen`: `pid`, `stdin`, `poll()`,
`wait()`, `terminate()`, `kill()`. The core is the server's child, not ours: its exit status comes
from the server over the connection the request was made on (where the server went first, the core's
pid is watched until it has gone, and its status reads as SIGKILL). Our end of its stdin stays open
until it has exited: the core takes the pipe's end as ours (see zygote.py)."""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import IO

import msgspec

from splitserve.tempdirs import process_gone
from splitserve.wire.lifecycle import ZYGOTE_ENV, CoreExited, CoreFork, CoreForked

log = logging.getLogger(__name__)

FORK_TIMEOUT_S = 120.0  # for the answer: the server may still be importing when asked


class ForkedCore:
    keeps_stdin = True  # the core's lifeline: not closed after the spec (core_client.py)

    def __init__(self, conn: socket.socket, stdin: IO[str]) -> None:
        self.stdin, self.returncode = stdin, None
        self._pid: int | None = None
        self._conn, self._forked, self._exited = conn, threading.Event(), threading.Event()
        threading.Thread(target=self._answers, name="core-fork", daemon=True).start()

    @property
    def pid(self) -> int:
        """The core's pid (waits for the server's answer: it may still be importing when asked)."""
        self._forked.wait()
        return self._pid if self._pid is not None else -1

    def _answers(self) -> None:
        """CoreForked, then CoreExited; a server that goes away (or never answers) reads as the core's
        SIGKILL, which PR_SET_PDEATHSIG gave it (or no core was made)."""
        code = -signal.SIGKILL
        answers = self._conn.makefile("rb")
        try:
            self._conn.settimeout(FORK_TIMEOUT_S)
            self._pid = msgspec.json.decode(answers.readline(), type=CoreForked).pid
            self._forked.set()
            self._conn.settimeout(None)
            line = answers.readline()
            if line:
                code = msgspec.json.decode(line, type=CoreExited).code
        except (OSError, msgspec.DecodeError) as exc:
            if not self._forked.is_set():
                log.error("the engine-core fork server did not fork a core: %s", exc)
        self._forked.set()
        while code == -signal.SIGKILL and self._pid is not None and not process_gone(self._pid):
            time.sleep(0.1)  # the server went first: the core is nobody's child now; watch its pid
        answers.close()
        self._conn.close()
        self.returncode = code
        self._exited.set()
        try:
            self.stdin.close()
        except OSError:
            pass

    def poll(self) -> int | None:
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._exited.wait(timeout):
            raise subprocess.TimeoutExpired(f"engine core {self.pid}", timeout or 0.0)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.returncode is None and self._pid is not None:
            try:
                os.kill(self._pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        """SIGKILL, and the end of its stdin: a core not forked yet reads no spec and exits."""
        self.send_signal(signal.SIGKILL)
        try:
            self.stdin.close()
        except OSError:
            pass


def fork_core(env: dict[str, str]) -> ForkedCore | None:
    """Ask the fork server for an engine core, with `env` and our stderr as its stdout and stderr, and
    return at once (its pid comes when the server has forked it); None where there is no server (not
    set, or gone: the caller spawns one instead)."""
    address = os.environ.get(ZYGOTE_ENV)
    if not address:
        return None
    read_end, write_end = os.pipe()
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        conn.settimeout(FORK_TIMEOUT_S)
        conn.connect(address)
        err = sys.stderr.fileno()
        body = msgspec.json.encode(CoreFork(env=env)) + b"\n"
        socket.send_fds(conn, [body], [read_end, err, err])
    except OSError as exc:
        log.warning("no engine-core fork server at %s (%s); spawning the core", address, exc)
        conn.close()
        os.close(write_end)
        return None
    finally:
        os.close(read_end)
    return ForkedCore(conn, os.fdopen(write_end, "w"))


__all__ = ["ZYGOTE_ENV", "ForkedCore", "fork_core"]
