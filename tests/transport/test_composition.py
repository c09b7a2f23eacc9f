"""What two backends share is composed, never inherited: no mover or wire subclasses another
or a shared base. GPU movers hold a GpuTwoSided; tcp and shm are one StreamMover holding each its wire."""

from __future__ import annotations

import importlib

import pytest

from splitserve.transport.host_stream import StreamMover

PARTS = {
    "tcp": ("splitserve.transport.tcp", "TcpWire"),
    "shm": ("splitserve.transport.shm", "ShmWire"),
    "cuda_ipc": ("splitserve.transport.cuda_ipc", "CudaIpcMover"),
    "nccl": ("splitserve.transport.nccl", "NcclMover"),
    "nixl": ("splitserve.transport.nixl", "NixlMover"),
}


@pytest.mark.parametrize("backend", sorted(PARTS))
def test_no_backend_part_inherits(backend):
    module, name = PARTS[backend]
    cls = getattr(importlib.import_module(module), name)
    assert cls.__bases__ == (object,), f"{name} inherits from {cls.__bases__}"
    assert cls.backend == backend


@pytest.mark.parametrize("backend", ["tcp", "shm"])
def test_stream_backends_are_one_mover_over_their_wire(backend, make):
    assert StreamMover.__bases__ == (object,)
    channel = make(backend)
    assert type(channel.mover) is StreamMover and type(channel.mover.wire).__name__ == PARTS[backend][1]
    assert channel.backend == backend
