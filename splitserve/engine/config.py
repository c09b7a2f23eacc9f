"""Engine knobs, and sizing of the KV block pool from a memory budget."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.model.config import ModelConfig
from splitserve.model.weight_cache import WeightCache, resolve_cache_dir

CPU_BATCHED_TOKENS = 1024
GPU_BATCHED_TOKENS = 2048
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None  # an HF dir, a GGUF file, random:SHAPE; None = the embedded default model
    tokenizer: str | None = None  # an HF dir or GGUF file whose tokenizer to use (default: the model's)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    dtype: str = "auto"  # auto (fp32 on CPU, bf16 on CUDA) | float32 | bfloat16 | float16
    block_size: int = 16
    max_num_seqs: int = 128
    # Tokens one step may take (prefill chunks + decode rows). None: CPU_BATCHED_TOKENS on CPU (a smaller
    # chunk lets the first prompts of a burst answer sooner at the same throughput: the CPU's matmul rate
    # is flat from ~512 rows), GPU_BATCHED_TOKENS on CUDA. `batched_tokens(device)` resolves it.
    max_num_batched_tokens: int | None = None
    max_model_len: int | None = None  # None: the model's max_position_embeddings, capped at 8192
    kv_cache_bytes: int | None = None  # explicit KV budget; wins over the fraction
    gpu_memory_utilization: float = 0.9  # CUDA: this worker's share of the device (weights + KV + rest)
    cpu_kv_cache_fraction: float = 0.1  # CPU: fraction of host memory for KV when no bytes given
    enable_prefix_caching: bool = True
    state_checkpoints: int = 8  # hybrid models' prefix caching: recurrent states kept (engine/state_cache.py)
    # hybrid models, CUDA: recurrent-state rows the KV transport allocates on the device after the cache
    # (cuda_ipc's state arena on a prefill worker, fetch staging on a decode worker): held back from the
    # KV budget, so that `gpu_memory_utilization` shares still add up (set by the worker for its transport)
    transfer_state_rows: int = 0
    seed: int = 0
    kv_shared_memory: bool = False  # CPU: KV in a memfd, so shm KV fetchers copy straight out of it
    attention_backend: str = "auto"  # auto (triton on CUDA when it can run, else torch) | torch | triton
    # hybrid models' linear-attention prefill: auto (fla on CUDA when fla-core imports, else torch) |
    # torch (one chunk at a time, the reference) | fla (all chunks of a step per launch; model/gdn_prefill.py)
    linear_attention_backend: str = "auto"
    enforce_eager: bool = False  # CUDA: no decode CUDA graphs (they need the triton backend)
    # Overlap the host's work with the GPU's in steady decode: step N+1 is launched with step N's
    # tokens still on the device, then step N's are read and stop conditions checked (engine.py).
    # None: on for CUDA, off for the CPU (where nothing runs asynchronously to overlap with).
    async_scheduling: bool | None = None
    # CPU: "fp32" (projections through oneDNN, token-exact with HF) or "int4" (weight-only int4 per group
    # of 32, int8 LM head, bf16 activations: model/cpu_linear.py; its agreement: bench/cpu_quant.py)
    cpu_weights: str = "fp32"
    progress: bool = True
    # Host-side cache of converted weights (model/weight_cache.py): "auto" = $SPLITSERVE_CACHE_DIR/weights
    # or ~/.cache/splitserve/weights; a path (e.g. /dev/shm/splitserve-weights); None or "off" disables
    weight_cache_dir: str | None = "auto"
    weight_cache_max_gb: float | None = 64.0  # least recently used entries are evicted beyond this
    weight_cache_verify: bool = True  # CRC32 of every chunk on load (see weight_cache.py for the cost)
    grammar_threads: int = 2  # threads compiling grammars (xgrammar releases the GIL meanwhile)
    grammar_timeout_s: float = 30.0  # a request whose grammar has not compiled by then fails (a 503)

    def torch_device(self) -> torch.device:
        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def batched_tokens(self, device: torch.device) -> int:
        """The step's token budget on `device`: `max_num_batched_tokens`, or the device's default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_BATCHED_TOKENS if device.type == "cpu" else GPU_BATCHED_TOKENS

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(_DTYPES)}")
        return _DTYPES[self.dtype]

    def weight_cache(self) -> WeightCache | None:
        """The weight cache these knobs describe, or None when it is off."""
        directory = resolve_cache_dir(self.weight_cache_dir)
        if directory is None:
            return None
        max_bytes = None if self.weight_cache_max_gb is None else int(self.weight_cache_max_gb * 1e9)
        return WeightCache(directory, max_bytes, self.weight_cache_verify)

    def resolve_max_model_len(self, cfg: ModelConfig) -> int:
        if self.max_model_len is None:
            return min(cfg.max_position_embeddings, 8192)
        if self.max_model_len > cfg.max_position_embeddings:
            raise ValueError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings "
                f"{cfg.max_position_embeddings}"
            )
        return self.max_model_len


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
