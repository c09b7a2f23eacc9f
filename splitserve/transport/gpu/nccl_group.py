"""nccl's process groups: one two-rank group per connection (`make_group`, `PairGroup`), waiting on its
work against a deadline and the control socket (`wait_done`), and how a transfer is cut into chunks.
Its life of a connection is in nccl.py."""

from __future__ import annotations

import contextlib
import socket
import time
from collections.abc import Callable, Iterator, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from splitserve.transport.errors import TransferTimeout, TransportError
from splitserve.transport.protocol import Deadline
from splitserve.transport.trace import gpu_mark, mark

POLL_PEER_S = 0.01  # how often a waiting side checks that the control connection is still up


SPIN_S = 0.002  # a waiting side yields without sleeping this long, then sleeps in short naps


def nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
    except Exception:  # noqa: BLE001 - no NCCL in this build
        return None
    return ".".join(str(v) for v in version) if isinstance(version, tuple) else str(version)


NCCL_CONFIG: dict[str, int] = {}  # ncclConfig_t fields for our groups (e.g. min_ctas), if any


def make_group(
    store: dist.Store, rank: int, device: torch.device, timeout_s: float, config: dict | None = None
) -> Any:
    """A two-rank process group on `store`: NCCL for a GPU; Gloo for the CPU (the tests' stand-in)."""
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        for key, value in (NCCL_CONFIG if config is None else config).items():
            setattr(options.config, key, value)
        return dist.ProcessGroupNCCL(store, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    options._timeout = timeout
    return dist.ProcessGroupGloo(store, rank, 2, options)


class PairGroup:
    """One connection's process group and its store; aborted when the connection closes."""

    def __init__(self, group: Any, store: dist.Store) -> None:
        self.group = group
        self.store = store
        self.aborted = False

    def abort(self) -> None:
        if not self.aborted:
            self.aborted = True
            with contextlib.suppress(Exception):
                self.group.abort()

    def close(self) -> None:
        self.abort()


@contextlib.contextmanager
def aborting(pair: PairGroup, what: str) -> Iterator[None]:
    """Abort the pair's group when the NCCL work inside fails (its peer may be half-way through a
    send or receive: the group cannot be trusted again); c10d's RuntimeError becomes a TransportError
    "`what` failed: ..."."""
    try:
        yield
    except TransportError:
        pair.abort()
        raise
    except RuntimeError as exc:
        pair.abort()
        raise TransportError(f"{what} failed: {exc}") from exc


def chunk_spans(n: int, per: int) -> list[tuple[int, int]]:
    return [(a, min(a + per, n)) for a in range(0, n, per)]


def wait_done(
    works: Sequence[Any],
    pair: PairGroup,
    device: torch.device,
    deadline: Deadline,
    peer_gone: Callable[[], bool],
    what: str,
) -> None:
    """Block until `works` (and everything queued after them on our stream) finished; on the deadline
    or a lost peer, abort the group and raise."""
    if device.type != "cuda":  # Gloo (tests): its own timeout bounds the wait
        for work in works:
            work.wait(timedelta(seconds=deadline.remaining(what)))
        return
    for work in works:
        work.wait()  # our stream waits for NCCL's (no CPU wait)
    gpu_mark(f"{what} finished", device)
    done = torch.cuda.Event()
    done.record()
    start = checked = time.monotonic()
    mark(f"{what}: waiting")
    while not done.query():
        now = time.monotonic()
        if now >= deadline.at:
            pair.abort()
            raise TransferTimeout(f"{what}: deadline of {deadline.total_s:.3g}s passed")
        if now - checked >= POLL_PEER_S:
            checked = now
            if peer_gone():
                pair.abort()
                raise TransportError(f"{what}: the peer closed the connection")
        time.sleep(0 if now - start < SPIN_S else 20e-6)
    mark(f"{what}: seen done")


def sock_gone(sock: socket.socket) -> bool:
    try:
        return sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:
        return True
