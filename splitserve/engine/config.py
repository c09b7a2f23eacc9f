"""Sizing of the KV block pool from a memory budget, and its allocation (the engine's knobs themselves,
`EngineConfig`, are config/engine.py's)."""

from __future__ import annotations

import math
import os
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitserve.model.config import ModelConfig

if TYPE_CHECKING:
    from splitserve.config.engine import EngineConfig


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one KV block across all layers (K and V)."""
    elem = torch.empty((), dtype=dtype).element_size()
    return 2 * cfg.num_kv_layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


# This process's CUDA context, cuBLAS and Triton workspaces: device memory that torch's allocator does not
# count (measured 0.5-0.6 GiB on an H200 with torch 2.11).
CUDA_CONTEXT_BYTES = 640 * 2**20
_HEADROOM_BYTES = 256 * 2**20  # left free beyond the budget, for allocations after the KV cache


def kv_budget_bytes(config: EngineConfig, device: torch.device, reserve_bytes: int = 0) -> int:
    """Bytes for the KV cache. CUDA: `gpu_memory_utilization` is this worker's share of the device,
    whatever other processes hold (two workers at 0.45 share one GPU): the share, less what this
    process holds (torch's reserved memory and its CUDA context) and `reserve_bytes` (the peak
    activations of a warm-up forward pass and the CUDA graphs' memory, measured by the engine).
    Refuses, naming the knobs, when that is more than the device has free."""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    if device.type != "cuda":
        return int(_host_memory_bytes() * config.cpu_kv_cache_fraction)
    free, total = torch.cuda.mem_get_info(device)
    own = torch.cuda.memory_reserved(device) + CUDA_CONTEXT_BYTES
    share = int(total * config.gpu_memory_utilization)
    budget = share - own - reserve_bytes
    if budget > free - reserve_bytes - _HEADROOM_BYTES:
        others = max(0, total - free - own)
        raise ValueError(
            f"memory_utilization {config.gpu_memory_utilization} gives this worker {share / 2**30:.1f} GiB "
            f"of the device's {total / 2**30:.1f} GiB; it holds {own / 2**30:.1f} GiB and needs "
            f"{reserve_bytes / 2**30:.1f} GiB for activations, but other processes hold "
            f"{others / 2**30:.1f} GiB and only {free / 2**30:.1f} GiB are free: lower memory_utilization "
            "(the shares of the workers on one GPU should sum to at most 0.9) or give kv_cache_mb"
        )
    if budget <= 0:
        raise ValueError(
            f"memory_utilization {config.gpu_memory_utilization} gives this worker "
            f"{share / 2**30:.1f} GiB of the device, no more than the {(own + reserve_bytes) / 2**30:.1f} "
            "GiB its weights, context and activations take: raise memory_utilization or give kv_cache_mb"
        )
    return budget


def allocate_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, shared: bool = False
) -> torch.Tensor:
    """A zero-filled KV tensor. On CPU the zeros come from calloc, so pages are touched lazily
    (torch.zeros would write every byte up front: seconds for a few GiB). `shared` (CPU): in a memfd,
    so that shm KV fetchers can map it and copy blocks straight out (transport/shm_direct.py; also lazy).

    NOTE: it must be zeros, not garbage: attention masks padded slots to weight 0, and 0 * NaN is NaN.
    """
    if shared and device.type == "cpu":
        from splitserve.transport.shm_direct import allocate_shared_kv

        return allocate_shared_kv(shape, dtype)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
