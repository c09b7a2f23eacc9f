"""Rank 0 starts the other ranks of its tensor-parallel group, meets them, and watches them.

    ranks = RankProcesses.start(config, device)   # children start importing torch at once
    group = ranks.group                           # once every rank has joined the store
    ...
    ranks.stop()                                  # after the runner told them to leave

Each rank is `python -m splitserve.engine.tp.worker`, its spec (the engine config, its rank, the store's
port, its thread count) on stdin. It exits when rank 0's process goes (it polls its parent) or when a
collective fails because a peer went. A rank that dies while rank 0 serves takes the replica down:
the watcher logs it and, in an engine-core process (`EXIT_ON_RANK_DEATH`), exits rank 0's process with
`RANK_DIED_STATUS`; the worker front end then fails the requests in flight and the runtime restarts the
replica whole. Elsewhere (an engine in a test or a script) the next step fails instead.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import subprocess
import sys
import threading
import time

import torch
import torch.distributed as dist

from splitserve.config.engine import EngineConfig
from splitserve.engine.tp.group import TPGroup

log = logging.getLogger(__name__)

JOIN_TIMEOUT_S = 600.0  # ranks import torch and reach the store within this
EXIT_ON_RANK_DEATH = False  # set by the engine core: a dead rank ends rank 0's process
RANK_DIED_STATUS = 70


class RankDied(RuntimeError):
    """A tensor-parallel rank other than 0 exited."""


class RankProcesses:
    def __init__(self, procs: list[subprocess.Popen], group: TPGroup) -> None:
        self.procs = procs
        self.group = group
        self.dead: str | None = None  # why, once a rank died
        self._stopping = False
        for rank, proc in enumerate(procs, start=1):
            threading.Thread(
                target=self._watch, args=(rank, proc), name=f"tp-rank-{rank}", daemon=True
            ).start()

    @classmethod
    def start(cls, config: EngineConfig, device: torch.device) -> RankProcesses:
        size = config.tensor_parallel_size
        store = dist.TCPStore(
            "127.0.0.1", 0, size, True, timeout=_seconds(JOIN_TIMEOUT_S), wait_for_workers=False
        )
        spec = dataclasses.asdict(dataclasses.replace(config, progress=False))
        procs = []
        for rank in range(1, size):
            proc = subprocess.Popen(
                [sys.executable, "-m", "splitserve.engine.tp.worker"], stdin=subprocess.PIPE, text=True
            )
            assert proc.stdin is not None
            threads = torch.get_num_threads()
            spec_line = {
                "engine": spec,
                "rank": rank,
                "port": store.port,
                "threads": threads,
                "device": str(device),
            }
            proc.stdin.write(json.dumps(spec_line))
            proc.stdin.close()
            procs.append(proc)
        _wait_joined(store, procs)
        return cls(procs, TPGroup(0, size, store, device, config.tensor_parallel_one_device))

    def check(self) -> None:
        """Raise RankDied when a rank has exited."""
        if self.dead is not None:
            raise RankDied(self.dead)

    def _watch(self, rank: int, proc: subprocess.Popen) -> None:
        code = proc.wait()
        if not self._stopping:
            self.broken(f"tensor-parallel rank {rank} (pid {proc.pid}) exited with status {code}")

    def broken(self, why: str) -> None:
        """The group cannot step again: every later step raises RankDied; an engine core exits."""
        if self.dead is not None:
            return
        self.dead = why
        log.error("%s: the replica goes down with it", why)
        if EXIT_ON_RANK_DEATH:
            logging.shutdown()
            os._exit(RANK_DIED_STATUS)
        for proc in self.procs:  # out of step with rank 0: nothing they compute is read again
            proc.kill()

    def stop(self, timeout_s: float = 10.0) -> None:
        """Wait for the ranks to leave (the runner told them), then kill any left."""
        self._stopping = True
        deadline = time.monotonic() + timeout_s
        for proc in self.procs:
            try:
                proc.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def _wait_joined(store: dist.TCPStore, procs: list[subprocess.Popen]) -> None:
    keys = [f"joined/{rank}" for rank in range(1, len(procs) + 1)]
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    while not store.check(keys):
        for rank, proc in enumerate(procs, start=1):
            if proc.poll() is not None:
                for other in procs:
                    other.kill()
                raise RankDied(
                    f"tensor-parallel rank {rank} exited with status {proc.returncode} before joining"
                )
        if time.monotonic() > deadline:
            for other in procs:
                other.kill()
            raise RankDied(f"tensor-parallel ranks did not join within {JOIN_TIMEOUT_S:.0f} s")
        time.sleep(0.02)


def _seconds(s: float):  # noqa: ANN202
    import datetime

    return datetime.timedelta(seconds=s)


__all__ = ["EXIT_ON_RANK_DEATH", "RANK_DIED_STATUS", "RankDied", "RankProcesses"]
