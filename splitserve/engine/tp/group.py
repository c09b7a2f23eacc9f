"""One tensor-parallel group: its ranks' process groups and the few collectives the engine uses.

Two process groups over one TCP store: `cpu` (gloo) carries the step broadcast and small agreements;
`dev` carries the model's all-reduces and all-gathers: NCCL on CUDA, the same gloo group on the CPU.
The groups are built directly on the store (not as torch.distributed's default group), so an engine
process may hold more than one, beside any other use of torch.distributed.
"""

from __future__ import annotations

import datetime
import pickle
from typing import Any

import torch
import torch.distributed as dist

# Ranks other than 0 wait in the step broadcast while the engine is idle: a rank that dies is noticed by
# the watcher (ranks.py) and by its peers' closed connections, not by this timeout.
IDLE_WAIT = datetime.timedelta(days=30)


class TPGroup:
    def __init__(self, rank: int, size: int, store: dist.Store, device: torch.device) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.store = store
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, IDLE_WAIT)
        self.dev = self.cpu
        if device.type == "cuda":
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
        self.bytes_reduced = 0  # the model's collectives, for the benchmark

    # ---- the model's collectives (model/parallel.py's `Collectives`) ----------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self.bytes_reduced += x.numel() * x.element_size()
        self.dev.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape on each), concatenated along the last dim, rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        self.dev.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    # ---- control -----------------------------------------------------------------------------------

    def broadcast(self, obj: Any = None) -> Any:
        """Rank 0's `obj` on every rank (pickled; a length, then the bytes)."""
        if self.rank == 0:
            data = torch.frombuffer(
                bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8
            )
            n = torch.tensor([data.numel()], dtype=torch.int64)
        else:
            n = torch.zeros(1, dtype=torch.int64)
        self.cpu.broadcast([n], _root0()).wait()
        if self.rank != 0:
            data = torch.empty(int(n.item()), dtype=torch.uint8)
        self.cpu.broadcast([data], _root0()).wait()
        return obj if self.rank == 0 else pickle.loads(data.numpy().tobytes())

    def agree_min(self, *values: int) -> tuple[int, ...]:
        """Each value's minimum over the ranks (sizes every rank can hold)."""
        t = torch.tensor(values, dtype=torch.int64)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.MIN
        self.cpu.allreduce([t], opts).wait()
        return tuple(int(v) for v in t.tolist())


def rank_device(device0: torch.device, rank: int) -> torch.device:
    """Rank `rank`'s device: the CPU, or the CUDA device `rank` places after rank 0's."""
    if device0.type != "cuda":
        return device0
    return torch.device("cuda", (device0.index or 0) + rank)


def _root0() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


__all__ = ["IDLE_WAIT", "TPGroup", "rank_device"]
