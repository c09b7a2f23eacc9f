"""Everything an `LLMEngine` is built from, apart from the step: the weights (loaded, random, or
reused), the tokenizer, the attention backends, the CPU projections, the warm-up profiling pass that
sizes the KV cache on CUDA, the cache itself, the state slots and checkpoints, the block pool, the
scheduler, the model runner and its CUDA graphs.

    parts = build(config, tokenizer, loaded)     # -> EngineParts; LLMEngine.__init__ keeps them

Order matters on CUDA: the warm-up pass runs before the cache exists (its peak is held back from the
cache's budget), and the graphs are captured last, over the real cache.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from splitserve.config.engine import EngineConfig
from splitserve.config.speculative import speculative_config
from splitserve.engine import cpu_heap
from splitserve.engine.block_manager import BlockManager
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.config import allocate_kv_cache, block_bytes, kv_budget_bytes
from splitserve.engine.memory_plan import MemoryPlan
from splitserve.engine.memory_profile import cap_allocator, cuda_memory_plan, profile_run, state_bytes
from splitserve.engine.prefill_graphs import graph_tokens
from splitserve.engine.runner import ModelRunner
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.spec.rows import MAX_ROWS
from splitserve.engine.state_cache import StateCheckpoints
from splitserve.engine.state_pool import StatePool
from splitserve.engine.tp import build as tp_build
from splitserve.engine.tp.journal import JournaledCheckpoints, JournaledStatePool
from splitserve.engine.tp.runner import TPRunner
from splitserve.engine.verify_graphs import verify_graph_shapes
from splitserve.kernels.cpu import linear as cpu_linear
from splitserve.kernels.cpu.build import wait_started
from splitserve.model.attention import (
    AttentionBackend,
    TorchPagedAttention,
    TritonPagedAttention,
    triton_supported,
)
from splitserve.model.checkpoint import is_random_source
from splitserve.model.config import ModelConfig
from splitserve.model.gdn_prefill import resolve_backend as resolve_linear_backend
from splitserve.model.loader import LoadedModel, load_model, resolve_model_path
from splitserve.model.random_weights import random_model, random_source_config
from splitserve.model.tokenizer import Tokenizer, load_tokenizer

log = logging.getLogger(__name__)


@dataclass
class EngineParts:
    """What `build` made; `LLMEngine` keeps each under the same name."""

    device: torch.device
    dtype: torch.dtype
    loaded: LoadedModel
    model_path: str
    max_model_len: int
    tokenizer: Tokenizer | None
    eos_token_ids: tuple[int, ...]
    kv_cache: (
        torch.Tensor
    )  # the KV cache: [num_blocks (+1 scratch with graphs), layers, 2, block, heads, dim]
    states: StatePool
    pool: BlockPool
    scheduler: Scheduler
    runner: ModelRunner
    graph_capture_s: float
    memory_plan: MemoryPlan | None  # CUDA: how the worker's share was divided (engine/memory_plan.py)
    mtp_head: torch.nn.Module | None = None  # speculative method "mtp": the model's MTP head
    state_shapes: dict[str, tuple[tuple[int, ...], torch.dtype]] | None = None  # each state slot's tensors


def build(
    config: EngineConfig, tokenizer: Tokenizer | None | bool, loaded: LoadedModel | None
) -> EngineParts:
    """`tokenizer`: True loads the checkpoint's; `loaded`: reuse weights already in memory."""
    device = config.torch_device()
    dtype = config.torch_dtype(device)
    owned = loaded is None  # loaded here: nobody else reads these weights
    tp, ranks = tp_build.join(config) if config.tensor_parallel_size > 1 else (None, None)
    if tp is not None:  # this rank's shard (model/parallel.py); the cache below holds its heads
        if loaded is not None:
            raise ValueError("tensor_parallel_size > 1 loads its own shards: no preloaded weights")
        loaded, path = tp_build.load_shard(config, device, dtype, tp)
    elif is_random_source(config.model):  # random weights at a named shape (benchmarks)
        path = str(config.model)
        loaded = loaded or random_model(
            random_source_config(path), device, dtype, config.resolve_max_model_len
        )
    else:
        path = resolve_model_path(config.model)
        if loaded is None:
            cache = config.weight_cache()
            loaded = load_model(path, device, dtype, config.resolve_max_model_len,
                                progress=config.progress, weight_cache=cache)  # fmt: skip
    cfg = loaded.config
    max_model_len = config.resolve_max_model_len(cfg)
    if tokenizer is True:
        tokenizer = load_tokenizer(config.model, config.tokenizer, cfg.eos_token_ids, loaded.checkpoint)
    tok: Tokenizer | None = tokenizer or None
    eos_token_ids = tok.eos_token_ids if tok else cfg.eos_token_ids
    block_size = config.block_size
    attn = attention_backend(config, cfg, loaded, device)
    linear_attention_backend(config, loaded, device)
    if device.type == "cpu":
        if cpu_heap.keep_freed_memory():
            log.info("CPU: malloc keeps freed blocks up to 32 MB (step temporaries reuse mapped pages)")
        # an engine core's own weights: oneDNN's layout for long products after ready (core/loop.py)
        defer = owned and cpu_linear.DEFER_ONEDNN
        panels = panel_store(config, loaded)  # mapped from the weight cache, not packed here
        counts = cpu_linear.prepare_model(loaded.model, config.cpu_weights, defer, panels)
        dropped = cpu_linear.drop_dense(loaded.model) if owned and cpu_linear.DROP_DENSE else 0
        log.info("CPU projections (%s): %s; dense copies dropped: %.0f MB", config.cpu_weights, counts,
                 dropped / 2**20)  # fmt: skip
        enable = getattr(loaded.model, "enable_cpu_fused", None)
        if enable is not None and enable():
            log.info("CPU fused ops on (RMSNorm + residual, q/k norm + rotary + KV store)")
            loaded.model.cpu_layer = loaded.model.cpu_layer and tp is None  # its products skip the all-reduce
        if built := wait_started():  # the engine is built once its ops are: no request waits on a compiler
            log.warning("CPU ops compiled at start (`python -m splitserve.model.prepare` builds them "
                        "ahead): %s", ", ".join(built))  # fmt: skip
    mtp_head = _mtp_head(config, loaded, device, dtype)
    graphs = device.type == "cuda" and not config.enforce_eager and attn.batched_prefill
    if device.type == "cuda" and not graphs:
        log.info("decode CUDA graphs are off (enforce_eager or the torch attention backend)")
    if tp is not None:  # the model's collectives inside the graphs: NCCL's, not gloo's
        graphs = tp_build.graphs_allowed(tp, graphs)
    kv_layers = cfg.num_kv_layers + (mtp_head.num_kv_layers if mtp_head is not None else 0)
    layout = (kv_layers, 2, block_size, cfg.num_kv_heads, cfg.head_dim)  # of one block
    one_block = block_bytes(cfg, block_size, dtype, kv_layers)
    plan, max_seqs = None, config.max_num_seqs
    if device.type == "cuda":
        with torch.cuda.device(device):  # Triton launches on the current device
            activations, graph_bytes = profile_run(config, loaded, attn, layout, max_model_len, device, dtype)
            per_seq = -(-max_model_len // block_size)
            plan = cuda_memory_plan(
                config, loaded.model, activations, graph_bytes, one_block, per_seq, graphs, device
            )
        log.info(plan.describe())
        cap_allocator(plan, device)
        num_blocks = plan.num_blocks
        max_seqs = plan.state_slots if loaded.model.state_shapes() else max_seqs
        if max_seqs < config.max_num_seqs:
            log.warning("the memory share holds state for %d sequences at once, not max_num_seqs %d",
                        max_seqs, config.max_num_seqs)  # fmt: skip
    else:
        num_blocks = kv_budget_bytes(config, device) // one_block
    if tp is not None:  # every rank the same pool (the smallest any rank can hold), and the same graphs
        num_blocks, max_seqs, captures = tp.agree_min(num_blocks, max_seqs, int(graphs))
        graphs = bool(captures)
    # CUDA graphs: one block more, never handed out, for the padded rows of a graph step to write
    kv_shape = (num_blocks + int(graphs), *layout)
    kv = allocate_kv_cache(kv_shape, dtype, device, shared=config.kv_shared_memory)
    shapes = {**loaded.model.state_shapes(), **(mtp_head.state_shapes() if mtp_head is not None else {})}
    states = (JournaledStatePool if tp else StatePool)(shapes, max_seqs, device, graphs)
    prefix_caching = config.enable_prefix_caching
    checkpoints = None
    if prefix_caching and states.enabled:  # hybrid: prefixes end at recurrent-state checkpoints
        checkpoints = (JournaledCheckpoints if tp else StateCheckpoints)(
            loaded.model.state_shapes(), config.state_checkpoints, device
        )
        log.info("hybrid prefix caching: %d state checkpoints (%.2f GiB)", checkpoints.num_entries,
                 checkpoints.nbytes() / 2**30)  # fmt: skip
        prefix_caching = checkpoints.enabled
    pool = BlockPool(num_blocks, prefix_caching)
    scheduler = Scheduler(
        BlockManager(pool, block_size, states, checkpoints),
        max_seqs,
        config.batched_tokens(device),
        max_model_len,
    )
    runner = (TPRunner if ranks else ModelRunner)(loaded.model, kv, attn, block_size, states.states)
    if tp is not None:  # rank 0 records its state-slot operations for the other ranks (tp/journal.py)
        tp_build.wire_journal(runner, states, checkpoints, ranks)
    graph_capture_s = 0.0
    before_graphs = torch.cuda.memory_reserved(device) if device.type == "cuda" else 0
    if graphs:
        spec = speculative_config(config.speculative_config)
        # models without recurrent state replay verify chunks of up to MAX_ROWS tokens as decode rows
        fresh = MAX_ROWS if spec is not None and states.scratch is None else 1
        scratch = states.scratch
        graph_capture_s = runner.enable_cuda_graphs(max_seqs, max_model_len, num_blocks, scratch, fresh)
        if spec is not None and states.scratch is not None:  # hybrid verify steps (verify_graphs.py)
            # (not `shapes`: that name holds the state slots' shapes, returned below)
            verify = verify_graph_shapes(spec.num_speculative_tokens, max_seqs, spec.disable_by_batch_size)
            graph_capture_s += runner.enable_verify_graphs(verify, max_model_len, num_blocks, states.scratch)
            if mtp_head is not None:  # the MTP head's catch-up and drafting (spec/mtp_graphs.py)
                draft_batch = max(w for w, _ in verify)
                graph_capture_s += runner.enable_head_graphs(
                    mtp_head, spec.num_speculative_tokens, draft_batch, max_model_len, num_blocks
                )
        prefill_tokens = graph_tokens(loaded.model, config.batched_tokens(device), max_model_len)
        # (the MTP drafter reads every row's hidden state, which the prefill graphs do not keep)
        if prefill_tokens and states.scratch is not None and mtp_head is None:
            graph_capture_s += runner.enable_prefill_graphs(
                prefill_tokens, max_model_len, num_blocks, states.scratch
            )
    if graphs and plan is not None:
        held = torch.cuda.memory_reserved(device) - before_graphs
        log.info("CUDA graphs hold %.2f GiB (planned %.2f GiB)", held / 2**30, plan.costs.graphs / 2**30)
    log.info("KV cache: %d blocks of %d tokens (%.2f GiB); attention: %s", num_blocks, block_size,
             kv.numel() * kv.element_size() / 2**30, type(attn).__name__)  # fmt: skip
    return EngineParts(device, dtype, loaded, path, max_model_len, tok, eos_token_ids, kv, states, pool,
                       scheduler, runner, graph_capture_s, plan, mtp_head, shapes)  # fmt: skip


def panel_store(config: EngineConfig, loaded: LoadedModel) -> cpu_linear.PanelStore | None:
    """Weights mapped from the weight cache: their decode panels are mapped from it too, written there
    by the first engine that packs them (kernels/cpu/panel_cache.py)."""
    cache, found = config.weight_cache(), loaded.load_stats.get("cache") or {}
    if cache is None or loaded.load_stats.get("method") != "cache-mmap" or "path" not in found:
        return None
    if config.tensor_parallel_size > 1:  # each rank packs its own shard: the entry holds whole weights
        return None
    from splitserve.kernels.cpu.panel_cache import cached_panels

    return lambda weights: cached_panels(cache, found["path"], weights)


def _mtp_head(
    config: EngineConfig, loaded: LoadedModel, device: torch.device, dtype: torch.dtype
) -> torch.nn.Module | None:
    """The MTP head (model/qwen3_5_mtp.py) where the speculative method is "mtp"; its K/V layers join
    the cache's layout after the target's."""
    spec = speculative_config(config.speculative_config)
    if spec is None or spec.method != "mtp":
        return None
    if not loaded.config.num_mtp_layers:
        raise ValueError(f'speculative method "mtp": {loaded.config.architecture} has no MTP head')
    from splitserve.model.qwen3_5_mtp import load_mtp

    head = load_mtp(loaded, device, dtype)
    log.info("MTP head: %d layer(s), %d KV layer(s) after the model's", len(head.layers), head.num_kv_layers)
    return head


def attention_backend(
    config: EngineConfig, cfg: ModelConfig, loaded: LoadedModel, device: torch.device
) -> AttentionBackend:
    scale = cfg.head_dim**-0.5
    choice = config.attention_backend
    if choice not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, not {choice!r}")
    usable = triton_supported(device, cfg.head_dim)
    if choice == "triton" and not usable:
        raise ValueError(
            "attention_backend=triton needs CUDA, an importable triton and a power-of-two head_dim >= 16"
        )
    if choice == "triton" or (choice == "auto" and usable):
        enable = getattr(loaded.model, "enable_fused_kernels", None)
        if enable is not None and enable():
            log.info("fused Triton kernels on (RMSNorm + residual, q/k norm + rotary + KV store, SiLU)")
        return TritonPagedAttention(scale)
    return TorchPagedAttention(scale, fold_gqa=device.type == "cpu")


def linear_attention_backend(config: EngineConfig, loaded: LoadedModel, device: torch.device) -> None:
    """Hybrid models: the prefill path of the linear-attention layers (before the warm-up pass, which
    then compiles and tunes its kernels)."""
    choose = getattr(loaded.model, "set_linear_attention_backend", None)
    if choose is None:
        return
    backend = resolve_linear_backend(config.linear_attention_backend, device)
    choose(backend)
    log.info("linear-attention prefill: %s", backend)


__all__ = [
    "EngineParts",
    "attention_backend",
    "build",
    "linear_attention_backend",
    "panel_store",
    "state_bytes",
]
