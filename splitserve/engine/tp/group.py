"""One tensor-parallel group: its ranks' process groups and the few collectives the engine uses.

Two process groups over one TCP store: `cpu` (gloo) carries the step broadcast and small agreements;
`dev` carries the model's all-reduces and all-gathers: NCCL on CUDA, the same gloo group on the CPU.
The groups are built directly on the store (not as torch.distributed's default group), so an engine
process may hold more than one, beside any other use of torch.distributed.

NCCL's collectives are launched on the GPU like any kernel, so the decode and prefill CUDA graphs
capture them (`capturable`); each rank captures the same graphs in the same order and replays the one
rank 0's step picks, so the captured collectives meet. `one_device` (the engine's
`tensor_parallel_one_device`, a test mode) puts every rank on one GPU, which NCCL refuses: the model's
collectives then run over the gloo group, staged through the host, and cannot be captured.
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
    def __init__(
        self, rank: int, size: int, store: dist.Store, device: torch.device, one_device: bool = False
    ) -> None:
        self.rank, self.size, self.device = rank, size, device
        self.store = store
        self.cpu = dist.ProcessGroupGloo(dist.PrefixStore("gloo", store), rank, size, IDLE_WAIT)
        self.dev = self.cpu
        # CUDA graphs can capture the model's collectives (NCCL's kernels), not gloo's host-driven ones
        self.capturable = device.type == "cuda" and not one_device
        if self.capturable:
            self.dev = dist.ProcessGroupNCCL(dist.PrefixStore("nccl", store), rank, size)
        # a device tensor's collectives over gloo go through a host copy (one_device on CUDA)
        self.staged = device.type == "cuda" and not self.capturable
        self.bytes_reduced = 0  # the model's eager collectives (a graph's replays are not counted)

    # ---- the model's collectives (model/parallel.py's `Collectives`) ----------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum `x` over the ranks, in place."""
        self.bytes_reduced += x.numel() * x.element_size()
        if self.staged:
            host = x.cpu()
            self.dev.allreduce([host]).wait()
            return x.copy_(host)
        self.dev.allreduce([x]).wait()
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        """Every rank's `x` (same shape on each), concatenated along the last dim, rank order."""
        src = x.cpu() if self.staged else x
        parts = [torch.empty_like(src) for _ in range(self.size)]
        self.dev.allgather([parts], [src]).wait()
        return torch.cat(parts, dim=-1).to(x.device)

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


def rank_device(device0: torch.device, rank: int, one_device: bool = False) -> torch.device:
    """Rank `rank`'s device: the CPU, or the CUDA device `rank` places after rank 0's (rank 0's own
    with `one_device`)."""
    if device0.type != "cuda" or one_device:
        return device0
    return torch.device("cuda", (device0.index or 0) + rank)


def _root0() -> dist.BroadcastOptions:
    opts = dist.BroadcastOptions()
    opts.rootRank = 0
    return opts


__all__ = ["IDLE_WAIT", "TPGroup", "rank_device"]
