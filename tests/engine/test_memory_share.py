"""`gpu_memory_utilization` (manifest: engine.memory_utilization) is one worker's share of the device,
whatever other processes hold: two workers at 0.45 on one GPU both get a KV cache; a share that does
not fit what is free, or does not cover the worker's own weights, is refused naming the knobs. The CUDA
memory queries are faked (CI has no GPU)."""

from __future__ import annotations

import pytest
import torch

from splitserve.engine.config import CUDA_CONTEXT_BYTES, EngineConfig, kv_budget_bytes

GIB = 2**30
TOTAL = 140 * GIB
CUDA = torch.device("cuda", 0)


def _fake_device(monkeypatch, free: int, reserved: int) -> None:
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (free, TOTAL))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: reserved)


def test_two_workers_on_one_gpu_get_their_shares(monkeypatch):
    weights, activations = 18 * GIB, 2 * GIB
    config = EngineConfig(gpu_memory_utilization=0.45)
    # the first worker: only its own weights (and context) on the device
    _fake_device(monkeypatch, TOTAL - weights - CUDA_CONTEXT_BYTES, weights)
    first = kv_budget_bytes(config, CUDA, activations)
    assert first == int(TOTAL * 0.45) - weights - CUDA_CONTEXT_BYTES - activations
    # the second: the first worker's whole share is taken, and its own weights; the same budget
    held = int(TOTAL * 0.45)
    _fake_device(monkeypatch, TOTAL - held - weights - CUDA_CONTEXT_BYTES, weights)
    assert kv_budget_bytes(config, CUDA, activations) == first


def test_a_share_beyond_what_is_free_is_refused(monkeypatch):
    weights = 18 * GIB
    _fake_device(monkeypatch, TOTAL - int(TOTAL * 0.6) - weights - CUDA_CONTEXT_BYTES, weights)
    with pytest.raises(ValueError, match="lower memory_utilization .* or give kv_cache_mb"):
        kv_budget_bytes(EngineConfig(gpu_memory_utilization=0.5), CUDA, GIB)
    # the explicit budget still works
    assert kv_budget_bytes(EngineConfig(kv_cache_bytes=GIB), CUDA) == GIB


def test_a_share_below_the_weights_is_refused(monkeypatch):
    _fake_device(monkeypatch, TOTAL - 18 * GIB, 18 * GIB)
    with pytest.raises(ValueError, match="raise memory_utilization or give kv_cache_mb"):
        kv_budget_bytes(EngineConfig(gpu_memory_utilization=0.1), CUDA, GIB)
