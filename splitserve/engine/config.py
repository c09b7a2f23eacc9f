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


def block_bytes(cfg: ModelConfig, block_size: int, dtype: torch.dtype, layers: int | None = None) -> int:
    """Bytes of one KV block across all layers (K and V); `layers`: the cache's KV layers where they
    are more than the model's (an MTP head's)."""
    elem = torch.empty((), dtype=dtype).element_size()
    layers = cfg.num_kv_layers if layers is None else layers
    return 2 * layers * block_size * cfg.num_kv_heads * cfg.head_dim * elem


def kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for the KV cache off CUDA: `kv_cache_bytes`, or `cpu_kv_cache_fraction` of host memory.
    (On CUDA the worker's memory plan sizes it: engine/memory_plan.py.)"""
    if config.kv_cache_bytes is not None:
        return config.kv_cache_bytes
    return int(_host_memory_bytes() * config.cpu_kv_cache_fraction)


def allocate_kv_cache(
    shape: tuple[int, ...], dtype: torch.dtype, device: torch.device, shared: bool = False
) -> torch.Tensor:
    """A zero-filled KV tensor. On CPU the zeros come from calloc, so pages are touched lazily
    (torch.zeros would write every byte up front: seconds for a few GiB). `shared` (CPU): in a memfd,
    so that shm KV fetchers can map it and copy blocks straight out (transport/shm_direct.py; also lazy).

    NOTE: it must be zeros, not garbage: attention masks padded slots to weight 0, and 0 * NaN is NaN.
    """
    if shared and device.type == "cpu":
        from splitserve.transport.stream.shm_direct import allocate_shared_kv

        return allocate_shared_kv(shape, dtype)
    if device.type != "cpu":
        return torch.zeros(shape, dtype=dtype, device=device)
    nbytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    return torch.from_numpy(np.zeros(nbytes, dtype=np.uint8)).view(dtype).view(shape)


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
