"""The engine-core fork server: one process that has imported torch and the engine (and loaded the CPU
ops) once, and forks an engine core for each front end that asks, so that no core pays the ~1.3 s of
interpreter start-up and imports again (on a 2-core host, two cores importing at once take twice that).
The local runtime starts it for CPU deployments (runtime/zygote.py) and hands it a listening Unix
socket; a front end finds it through `$SPLITSERVE_CORE_ZYGOTE` (worker/core_fork.py).

    python -m splitserve.core.zygote FD FOLDER     # FD: the listening socket, inherited; FOLDER: its folder

Per connection: the front end sends a `CoreFork` line with three file descriptors (SCM_RIGHTS): the
core's stdin (a pipe the front end writes the spec to and keeps open), stdout and stderr. The server
forks; the child takes those as 0, 1 and 2, the front end's environment, and runs the engine core's
main from its spec on (core/loop.py `serve_spec`). The server answers `CoreForked` with the pid and,
once it has reaped the child, `CoreExited` with its status, then closes the connection.

Lifetimes: the server dies with the runtime (PR_SET_PDEATHSIG, set by its spawner); a forked core lives
as long as its front end: it stops when told, and dies when its stdin ends (the front end holds the
write end until the core has exited, so that a SIGKILLed front end closes it).
Fork safety: the server runs one thread and never runs a torch op, so that no thread pool (torch's
intra-op OpenMP pool) or ZMQ context exists when it forks; each core makes its own.
"""

from __future__ import annotations

import array
import os
import shutil
import signal
import socket
import sys

import msgspec

from splitserve.wire.lifecycle import CoreExited, CoreFork, CoreForked

MAX_LINE = 1 << 20  # a CoreFork line (the environment) is far below this
_children: dict[int, socket.socket] = {}  # pid -> its front end's connection


def _reap(*_: object) -> None:
    """SIGCHLD: reap every exited child and tell its front end its status."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        conn = _children.pop(pid, None)
        if conn is not None:
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall(msgspec.json.encode(CoreExited(code=code)) + b"\n")
            except OSError:
                pass  # the front end is gone
            conn.close()


def _receive(conn: socket.socket) -> tuple[CoreFork, list[int]]:
    """The request line and its three descriptors."""
    fds = array.array("i")
    data, ancdata, _flags, _addr = conn.recvmsg(MAX_LINE, socket.CMSG_SPACE(3 * fds.itemsize))
    for level, kind, payload in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    return msgspec.json.decode(data.strip(), type=CoreFork), list(fds)


def _child(listener: socket.socket, conn: socket.socket, req: CoreFork, fds: list[int]) -> None:
    """In the forked child: become the engine core of the front end that asked. Never returns."""
    code = 1
    try:
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        for s in (listener, conn, *_children.values()):
            s.close()
        _children.clear()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os.environ.clear()
        os.environ.update(req.env)
        from splitserve.core import loop

        # no PR_SET_PDEATHSIG to this server: the core lives as long as its front end (which stops it
        # gracefully, its transport's files removed) and no longer (the end of its stdin)
        code = loop.serve_spec(lifeline=True)
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else 1
    except BaseException:  # noqa: BLE001 - a child of the server must not go back into its loop
        import traceback

        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)


def serve(listener: socket.socket, folder: str | None = None, parent: int | None = None) -> None:
    """Accept, fork, answer; forever (the runtime ends it). Every second without a request it also
    looks for its runtime: gone (we were given to another parent), it goes as the SIGTERM of
    PR_SET_PDEATHSIG would have it go, its socket's folder removed."""
    signal.signal(signal.SIGCHLD, _reap)
    listener.settimeout(1.0)
    while True:
        try:
            conn, _ = listener.accept()
        except TimeoutError:
            if parent is not None and _runtime_gone(parent):
                _on_sigterm(folder, parent)
            continue
        conn.settimeout(None)
        try:
            req, fds = _receive(conn)
        except (OSError, msgspec.DecodeError, ValueError):
            conn.close()
            continue
        if len(fds) != 3:
            for fd in fds:
                os.close(fd)
            conn.close()
            continue
        sys.stdout.flush()
        sys.stderr.flush()
        # SIGCHLD held until the child is on record: one that exits at once is reaped with its answer
        signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGCHLD})
        pid = os.fork()
        if pid == 0:
            _child(listener, conn, req, fds)
        _children[pid] = conn
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGCHLD})
        for fd in fds:
            os.close(fd)
        try:
            conn.sendall(msgspec.json.encode(CoreForked(pid=pid)) + b"\n")
        except OSError:
            pass  # the front end went away: its core sees its stdin end and goes too


def _on_sigterm(folder: str | None, parent: int) -> None:
    """SIGTERM (the runtime's stop, or PR_SET_PDEATHSIG): where the runtime died (we were given to
    another parent), remove the socket's folder it would have removed."""
    if folder and _runtime_gone(parent):
        shutil.rmtree(folder, ignore_errors=True)
    os._exit(0)


def _runtime_gone(parent: int) -> bool:
    """The runtime is dead: we were given to another parent, or it is exiting (PR_SET_PDEATHSIG can
    arrive while the killed runtime is still our parent, a zombie or on its way to one)."""
    if os.getppid() != parent:
        return True
    try:
        with open(f"/proc/{parent}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return True
    return state in ("Z", "X", "x")


def main(argv: list[str] | None = None) -> int:
    """argv: the listening socket's descriptor, then its folder (removed if the runtime dies)."""
    args = sys.argv[1:] if argv is None else argv
    listener = socket.socket(fileno=int(args[0]))
    folder, parent = (args[1] if len(args) > 1 else None), os.getppid()
    signal.signal(signal.SIGTERM, lambda *_: _on_sigterm(folder, parent))
    import gc

    gc.disable()  # no collector passes over the imports (~0.1-0.3 s of them: heap.py); one pass below
    from splitserve.core import loop, setup  # noqa: F401 - loop: imported here once, for every core

    setup.warm_imports()
    # and what a core's build imports on some paths (a GGUF checkpoint, a KV connector), once here
    import splitserve.engine.kv_connector  # noqa: F401
    import splitserve.model.gguf_loader  # noqa: F401
    import splitserve.transport.backends  # noqa: F401
    from splitserve.kernels.cpu import build

    build.load_cached()
    # what the forked cores share stays shared: the collector does not touch it. No collection first:
    # a pass over torch's heap takes ~0.1 s, which every core's start would wait for, to free the few
    # cycles the imports left behind (~7k objects of ~280k)
    gc.freeze()
    gc.enable()  # in the forked cores too
    serve(listener, folder, parent)
    return 0


if __name__ == "__main__":
    sys.exit(main())
