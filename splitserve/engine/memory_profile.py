"""CUDA: the start-up measurements a worker's memory plan is made from (engine/memory_plan.py).

    activations, graphs = profile_run(config, loaded, attn, layout, max_model_len, device, dtype)
    plan = cuda_memory_plan(config, loaded, activations, graphs, layout_bytes..., device)

`profile_run` runs one step's worst case before the KV cache exists: a forward pass over
`max_num_batched_tokens` tokens split into prompts of at most `max_model_len` (at most max_num_seqs of
them), against a temporary cache and state slots just big enough, then the LM head over max_num_seqs
rows and the sampler's sort of those logits. torch's peak allocation over that pass, less what the pass
itself was given, is the step's activations (as vLLM's profile run measures them).
"""

from __future__ import annotations

import logging
import math

import torch

from splitserve.config.speculative import speculative_config
from splitserve.engine.memory_plan import (
    CUDA_CONTEXT_BYTES,
    FixedCosts,
    MemoryInputs,
    MemoryPlan,
    plan_memory,
    process_device_bytes,
)
from splitserve.engine.prefill_graphs import graph_tokens
from splitserve.engine.state_pool import StatePool
from splitserve.engine.verify_graphs import verify_graph_shapes
from splitserve.model.attention import AttentionBackend, AttentionMetadata, PrefillBatch, PrefillChunk
from splitserve.model.decoder import ForwardContext
from splitserve.model.loader import LoadedModel

log = logging.getLogger(__name__)


def profile_run(
    config,  # noqa: ANN001 - EngineConfig (engine/config.py imports this module's callers)
    loaded: LoadedModel,
    attn: AttentionBackend,
    block_layout: tuple[int, ...],
    max_model_len: int,
    dev: torch.device,
    dtype: torch.dtype,
) -> tuple[int, int]:
    """-> (activations, graphs): the peak bytes of one worst-case step beyond what it was given, and the
    estimated memory of the CUDA graphs that will be captured."""
    cfg = loaded.config
    budget = config.batched_tokens(dev)
    lens = _prompt_lengths(budget, max_model_len, config.max_num_seqs)
    tokens = sum(lens)
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(dev)
    before = torch.cuda.memory_allocated(dev)
    meta, kv, states = _dummy_batch(lens, config.block_size, block_layout, loaded, attn, dev, dtype)
    given = torch.cuda.memory_allocated(dev) - before
    model = loaded.model
    with torch.inference_mode():
        ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
        positions = torch.cat([torch.arange(n, device=dev) for n in lens])
        hidden = model(ids, positions, ForwardContext(attn, meta, kv, states.states))
        rows = min(tokens, config.max_num_seqs)
        logits = model.compute_logits(hidden[:rows]).float()
        del hidden
        # the sampler's worst case: probabilities, and a sort of them for top-k / top-p
        probs = logits.softmax(-1)
        sorted_probs, order = probs.sort(dim=-1, descending=True)
        sorted_probs.cumsum_(-1)
        del logits, probs, sorted_probs, order
    torch.cuda.synchronize(dev)
    peak = max(0, torch.cuda.max_memory_allocated(dev) - before - given)
    del kv, states, meta
    torch.cuda.empty_cache()
    # the decode graphs keep their own logits ([max_num_seqs, vocab] fp32, twice) and a small pool
    graphs = 2 * config.max_num_seqs * cfg.vocab_size * 4 + 256 * 2**20
    # hybrid models: the prefill graphs' pool, at most the activations of their longest chunk
    prefill_tokens = graph_tokens(model, budget, max_model_len)
    graphs += peak * (prefill_tokens + 64) // tokens if prefill_tokens else 0
    # hybrid models with speculation: the verify graphs' logits, one buffer of their largest step's rows
    spec = speculative_config(config.speculative_config)
    if spec is not None and model.state_shapes():
        k, cap = spec.num_speculative_tokens, spec.disable_by_batch_size
        shapes = verify_graph_shapes(k, config.max_num_seqs, cap)
        graphs += max(w * s for w, s in shapes) * cfg.vocab_size * 4
        if spec.method == "mtp":  # the MTP head's graphs (spec/mtp_graphs.py): a draft's logits, its rows
            rows = config.max_num_seqs + max(w * s for w, s in shapes)
            graphs += max(w for w, _ in shapes) * cfg.vocab_size * 4 + rows * cfg.hidden_size * 4
    log.info("warm-up pass over %d tokens (%d prompts): %.2f GiB of activations at peak", tokens, len(lens),
             peak / 2**30)  # fmt: skip
    return peak, graphs


def _prompt_lengths(budget: int, max_model_len: int, max_num_seqs: int) -> list[int]:
    """The step budget as prompts of at most max_model_len tokens, at most max_num_seqs of them."""
    n = min(max_num_seqs, -(-budget // max_model_len))
    tokens = min(budget, n * max_model_len)
    return [tokens // n + (1 if i < tokens % n else 0) for i in range(n)]


def _dummy_batch(
    lens: list[int],
    block_size: int,
    block_layout: tuple[int, ...],
    loaded: LoadedModel,
    attn: AttentionBackend,
    dev: torch.device,
    dtype: torch.dtype,
) -> tuple[AttentionMetadata, torch.Tensor, StatePool]:
    """Metadata of a step that prefills `lens` prompts whole, a cache and state slots just for them."""
    per_seq = [-(-n // block_size) for n in lens]
    kv = torch.zeros((sum(per_seq), *block_layout), dtype=dtype, device=dev)
    states = StatePool(loaded.model.state_shapes(), len(lens), dev)
    width = max(per_seq)
    tables = torch.zeros((len(lens), width), dtype=torch.int64, device=dev)
    chunks, slots, first, start = [], [], 0, 0
    for i, (n, nb) in enumerate(zip(lens, per_seq, strict=True)):
        blocks = torch.arange(first, first + nb, device=dev)
        tables[i, :nb] = blocks
        slots.append(first * block_size + torch.arange(n, device=dev))
        chunks.append(PrefillChunk(start, n, n, None if attn.batched_prefill else blocks))
        first, start = first + nb, start + n
    lens_t = torch.tensor(lens, device=dev)
    starts = torch.cumsum(lens_t, 0) - lens_t
    meta = AttentionMetadata(
        slot_mapping=torch.cat(slots),
        num_decode_tokens=0,
        decode_groups=(),
        prefills=tuple(chunks),
        seq_slots=torch.arange(len(lens), dtype=torch.int64, device=dev) if states.enabled else None,
        prefill_batch=PrefillBatch(starts, lens_t, lens_t, tables, max(lens)),
    )
    return meta, kv, states


def cuda_memory_plan(
    config,  # noqa: ANN001 - EngineConfig
    model: torch.nn.Module,
    activations: int,
    graphs: int,
    block_bytes: int,
    blocks_per_seq: int,
    scratch_slot: bool,
    dev: torch.device,
) -> MemoryPlan:
    """Measure what this process holds and make its plan (MemoryShareError where it cannot fit)."""
    torch.cuda.synchronize(dev)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(dev)
    reserved = torch.cuda.memory_reserved(dev)
    own = process_device_bytes(dev.index if dev.index is not None else torch.cuda.current_device())
    non_torch = max(CUDA_CONTEXT_BYTES, own - reserved) if own is not None else CUDA_CONTEXT_BYTES
    slot = state_bytes(model)
    shapes = getattr(model, "state_shapes", lambda: {})()
    checkpoints = config.state_checkpoints * slot if shapes and config.enable_prefix_caching else 0
    vocab_words = -(-int(getattr(getattr(model, "cfg", None), "vocab_size", 0)) // 32)
    # tensor_parallel_one_device: every rank of the group holds its share of this one device
    ranks_here = config.tensor_parallel_size if config.tensor_parallel_one_device else 1
    share = int(total * config.gpu_memory_utilization / ranks_here)
    inputs = MemoryInputs(
        device_total=total,
        device_free=free,
        held=reserved + non_torch,
        costs=FixedCosts(
            weights=reserved,
            non_torch=non_torch,
            activations=activations,
            graphs=graphs,
            transfer=config.transfer_state_rows * slot,
            grammar=2 * max(config.max_num_seqs, 64) * vocab_words * 4,  # device bitmask, double-buffered
            checkpoints=checkpoints,
        ),
        slot_bytes=slot,
        max_slots=config.max_num_seqs,
        scratch_slot=scratch_slot and slot > 0,
        block_bytes=block_bytes,
        blocks_per_seq=blocks_per_seq,
        share=None if config.kv_cache_bytes is not None else share,
        kv_bytes=config.kv_cache_bytes,
    )
    return plan_memory(inputs)


def state_bytes(model: torch.nn.Module) -> int:
    """One sequence's recurrent state (hybrid models; 0 otherwise)."""
    shapes = getattr(model, "state_shapes", lambda: {})()
    return sum(math.prod(shape) * dtype.itemsize for shape, dtype in shapes.values())


def cap_allocator(plan: MemoryPlan, dev: torch.device) -> None:
    """Keep torch's allocator inside the plan: past it, torch frees its cached blocks and retries before
    it fails, so fragmentation cannot carry the process over its share."""
    if plan.share is None:
        return
    index = dev.index if dev.index is not None else torch.cuda.current_device()
    total = torch.cuda.mem_get_info(index)[1]
    torch.cuda.set_per_process_memory_fraction(min(1.0, (plan.share - plan.costs.non_torch) / total), index)


__all__ = ["cap_allocator", "cuda_memory_plan", "profile_run", "state_bytes"]
