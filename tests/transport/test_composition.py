"""What two backends share is a component each holds, never a base class (issue 27): no payload mover
subclasses another mover or a shared base; GPU movers hold a GpuTwoSided, stream movers a HostStream."""

from __future__ import annotations

import importlib

import pytest

MOVERS = {
    "tcp": ("splitserve.transport.tcp", "TcpMover"),
    "shm": ("splitserve.transport.shm", "ShmMover"),
    "cuda_ipc": ("splitserve.transport.cuda_ipc", "CudaIpcMover"),
    "nccl": ("splitserve.transport.nccl", "NcclMover"),
    "nixl": ("splitserve.transport.nixl", "NixlMover"),
}


@pytest.mark.parametrize("backend", sorted(MOVERS))
def test_no_mover_inherits(backend):
    module, name = MOVERS[backend]
    cls = getattr(importlib.import_module(module), name)
    assert cls.__bases__ == (object,), f"{name} inherits from {cls.__bases__}"
    assert cls.backend == backend
