"""What two backends share is composed, never inherited: no mover, wire or link subclasses another
or a shared base. cuda_ipc and nccl are one GpuMover over each its link; tcp and shm are one StreamMover
over each its wire."""

from __future__ import annotations

import importlib

import pytest
from kv_helpers import SECRET, layout_of, small_kv

from splitserve.transport.gpu.mover import GpuMover
from splitserve.transport.stream.mover import StreamMover

PARTS = {
    "tcp": ("splitserve.transport.stream.tcp", "TcpWire"),
    "shm": ("splitserve.transport.stream.shm", "ShmWire"),
    "cuda_ipc": ("splitserve.transport.gpu.cuda_ipc", "CudaIpcLink"),
    "nccl": ("splitserve.transport.gpu.nccl", "NcclLink"),
    "nixl": ("splitserve.transport.nixl.mover", "NixlMover"),
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


@pytest.mark.parametrize("backend", ["cuda_ipc", "nccl"])
def test_gpu_backends_are_one_mover_over_their_link(backend):
    module, name = PARTS[backend]
    transport = getattr(importlib.import_module(module), name.replace("Link", "Transport"))
    double = type("Double", (transport,), {"cpu_test_double": True})
    kv = small_kv()
    with double(kv, layout_of(kv), secret=SECRET) as channel:
        assert GpuMover.__bases__ == (object,)
        assert type(channel.mover) is GpuMover and type(channel.mover.link).__name__ == name
        assert channel.backend == backend
