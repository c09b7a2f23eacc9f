"""The engine's knobs (`EngineConfig`): plain data, read by the manifest (whose engine section defaults to
them), the worker's command line and the engine. torch and the model code load only when a method that
needs them is called, so that the router can read a manifest without loading the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from splitserve.config.speculative import SpeculativeConfig

if TYPE_CHECKING:
    import torch

    from splitserve.model.config import ModelConfig
    from splitserve.model.weight_cache import WeightCache

CPU_BATCHED_TOKENS = 1024
GPU_BATCHED_TOKENS = 2048
_DTYPES = ("float32", "bfloat16", "float16")


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
    # CUDA: the share of the device this whole worker process may hold (weights, KV, state, activations,
    # graphs, buffers: engine/memory_plan.py)
    gpu_memory_utilization: float = 0.9
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
    # of 32, int8 LM head, bf16 activations: kernels/cpu/linear.py; its agreement: bench/cpu_quant.py)
    cpu_weights: str = "fp32"
    progress: bool = True
    # Host-side cache of converted weights (model/weight_cache.py): "auto" = $SPLITSERVE_CACHE_DIR/weights
    # or ~/.cache/splitserve/weights; a path (e.g. /dev/shm/splitserve-weights); None or "off" disables
    weight_cache_dir: str | None = "auto"
    weight_cache_max_gb: float | None = 64.0  # least recently used entries are evicted beyond this
    weight_cache_verify: bool = True  # CRC32 of every chunk on load (see weight_cache.py for the cost)
    grammar_threads: int = 2  # threads compiling grammars (xgrammar releases the GIL meanwhile)
    grammar_timeout_s: float = 30.0  # a request whose grammar has not compiled by then fails (a 503)
    # Speculative decoding (engine/spec/): a SpeculativeConfig, a dict of its fields (vLLM's
    # --speculative-config: {"method": "ngram", "num_speculative_tokens": 4, ...}) or None (off)
    speculative_config: SpeculativeConfig | dict | None = None
    # Tensor parallelism (vLLM's --tensor-parallel-size): ranks, one process each, that shard every layer
    # by heads (engine/tp/, model/parallel.py); gloo on the CPU, NCCL on CUDA. 1: one process, no sharding
    tensor_parallel_size: int = 1
    # A test mode of tensor parallelism on one GPU: every rank on the engine's device, the model's
    # collectives over gloo through the host (NCCL refuses two ranks of a group on one GPU), CUDA graphs
    # off. For testing the ranks' code on a machine of one GPU; slow, never for serving
    tensor_parallel_one_device: bool = False

    def torch_device(self) -> torch.device:
        import torch

        if self.device == "auto":
            return torch.device("cuda" if torch.cuda.is_available() else "cpu")
        return torch.device(self.device)

    def batched_tokens(self, device: torch.device) -> int:
        """The step's token budget on `device`: `max_num_batched_tokens`, or the device's default."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        return CPU_BATCHED_TOKENS if device.type == "cpu" else GPU_BATCHED_TOKENS

    def torch_dtype(self, device: torch.device) -> torch.dtype:
        import torch

        if self.dtype == "auto":
            return torch.bfloat16 if device.type == "cuda" else torch.float32
        if self.dtype not in _DTYPES:
            raise ValueError(f"unsupported dtype {self.dtype!r}; choose one of {', '.join(_DTYPES)}")
        return getattr(torch, self.dtype)

    def weight_cache(self) -> WeightCache | None:
        """The weight cache these knobs describe, or None when it is off."""
        from splitserve.model.weight_cache import WeightCache, resolve_cache_dir

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


__all__ = ["CPU_BATCHED_TOKENS", "EngineConfig", "GPU_BATCHED_TOKENS"]
