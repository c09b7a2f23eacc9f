"""Each rank's KV cache and state pools, seen from rank 0's process (the KV transfer runs there).

A prefill replica at tensor_parallel_size n serves every rank's KV from rank 0's process, and a decode
replica writes each rank's blocks from there: on one host that needs no extra process or copy when
the pools of ranks 1..n-1 live in shared memory. Those ranks allocate their cache and state tensors
in memfds (anonymous: nothing is left behind in /dev/shm) and post where they are (their pid and
descriptors) in the group's store; rank 0, their parent, maps them through /proc/<pid>/fd.

    publish(group, kv, states)      rank r > 0, at build: move the state tensors into shared memory, post
    pools = mapped(group)           rank 0: [rank 1's (kv, states), ...], mapped once
"""

from __future__ import annotations

import json
import mmap
import os

import torch

from splitserve.engine.state_pool import StatePool
from splitserve.engine.tp.group import TPGroup
from splitserve.transport.layout import dtype_name, torch_dtype
from splitserve.transport.stream.shm_direct import allocate_shared_kv, shared_kv_of

RankPool = tuple[torch.Tensor, dict[str, torch.Tensor]]  # (kv cache, state tensors by name)


def publish(group: TPGroup, kv: torch.Tensor, states: StatePool) -> None:
    """Rank r > 0: post where this rank's KV cache (allocated shared) and state tensors live."""
    for name, t in list(states.states.items()):  # before the runner reads the dict
        shared = allocate_shared_kv(tuple(t.shape), t.dtype)
        shared.copy_(t)
        states.states[name] = shared
    tensors = {"kv": kv, **{f"state.{n}": t for n, t in states.states.items()}}
    posted = {}
    for key, t in tensors.items():
        where = shared_kv_of(t)
        if where is None:
            raise RuntimeError(f"rank {group.rank}'s {key} is not in shared memory")
        posted[key] = {"fd": where.fd, "shape": list(t.shape), "dtype": dtype_name(t.dtype)}
    group.store.set(f"pools/{group.rank}", json.dumps({"pid": os.getpid(), "tensors": posted}))


def mapped(group: TPGroup) -> list[RankPool]:
    """Rank 0: every other rank's pools, mapped read-write (rank order, from rank 1)."""
    cached = getattr(group, "_mapped_pools", None)
    if cached is not None:
        return cached
    out = []
    for rank in range(1, group.size):
        posted = json.loads(group.store.get(f"pools/{rank}"))
        tensors = {key: _map(posted["pid"], spec) for key, spec in posted["tensors"].items()}
        states = {key.removeprefix("state."): t for key, t in tensors.items() if key.startswith("state.")}
        out.append((tensors["kv"], states))
    group._mapped_pools = out  # type: ignore[attr-defined]
    return out


def _map(pid: int, spec: dict) -> torch.Tensor:
    dtype = torch_dtype(spec["dtype"])
    shape = tuple(spec["shape"])
    nbytes = dtype.itemsize
    for d in shape:
        nbytes *= d
    fd = os.open(f"/proc/{pid}/fd/{spec['fd']}", os.O_RDWR)
    try:
        buf = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).view(shape)


__all__ = ["RankPool", "mapped", "publish"]
