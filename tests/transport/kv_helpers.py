"""Helpers shared by the KV transport tests (a uniquely named module: tests/ has several conftests)."""

from __future__ import annotations

import ctypes.util
import importlib.util
import time
from pathlib import Path

import pytest
import torch

from splitserve.transport import KVLayout
from splitserve.transport.stream.shm import SEGMENT_PREFIX, allocate_shared_kv

SECRET = "test-secret"
HAVE_NIXL = any(importlib.util.find_spec(n) for n in ("nixl", "nixl_cu12", "nixl_cu13"))
needs_nixl = pytest.mark.skipif(
    not HAVE_NIXL, reason="NIXL is not installed (pip install --no-deps nixl-cu12==1.5.1, then numpy)"
)
NIXL = pytest.param("nixl", marks=needs_nixl)  # a `backend` parameter: nixl over UCX, CPU memory
HAVE_LIBFABRIC = ctypes.util.find_library("fabric") is not None
SHM = Path("/dev/shm")


def our_segments() -> set[str]:
    return {p.name for p in SHM.glob(f"{SEGMENT_PREFIX}*")} if SHM.exists() else set()


def small_kv(num_blocks: int = 32, block_size: int = 16, dtype=torch.bfloat16, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(num_blocks, 2, 2, block_size, 2, 16, generator=gen).to(dtype)  # [N, L, 2, bs, H, D]


def shared_copy(kv: torch.Tensor) -> torch.Tensor:
    """The same bytes in a KV tensor allocated in shared memory (shm direct mode)."""
    out = allocate_shared_kv(kv.shape, kv.dtype)
    out.copy_(kv)
    return out


def layout_of(kv: torch.Tensor, fingerprint: str = "m", states: tuple = ()) -> KVLayout:
    return KVLayout.from_tensor(kv, fingerprint, states)


def wait_for(predicate, timeout_s: float = 5.0) -> bool:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.01)
    return bool(predicate())
