"""How a CUDA worker divides its share of the device among everything it holds there.

`memory_utilization` (EngineConfig.gpu_memory_utilization) is the share of the device's memory that the
whole worker process may hold, whatever other processes on the GPU hold. It pays, in this order, for

    weights       what torch holds once the model is loaded (weights, rotary tables, buffers)
    non_torch     device memory outside torch's allocator: the CUDA context, cuBLAS and Triton modules
                  and workspaces (this process's own usage as NVML reports it, less torch's reserved
                  memory; CUDA_CONTEXT_BYTES where NVML cannot tell)
    activations   the peak of one step, profiled at start: a forward pass over max_num_batched_tokens
                  tokens, the LM head over max_num_seqs rows and a sampler's sort of those logits
    graphs        the CUDA graphs' memory pools and static buffers (estimated before capture)
    transfer      the KV transport's device buffers (cuda_ipc's state arena, fetch staging rows)
    grammar       structured outputs' token bitmasks on the device
    checkpoints   hybrid models' prefix-cache state checkpoints
    margin        what is left unplanned, for memory that grows after start (kernels compiled for new
                  shapes, handles of new streams, allocator rounding): MARGIN_FRACTION of the share,
                  at least MIN_MARGIN_BYTES

and the rest goes to the two pools that grow with the number of sequences: hybrid models' recurrent
state slots (one per running sequence, at most max_num_seqs) and the KV cache's blocks. Where the rest
cannot give every slot room for a max_model_len sequence, fewer slots are made (fewer sequences run at
once) and the KV cache keeps what they need. A share that cannot hold the weights, or leaves no room for
one max_model_len sequence after the costs above, is refused at start with every figure.

`kv_cache_mb` (EngineConfig.kv_cache_bytes) instead fixes the KV cache's size; the plan then adds the
same costs on top and refuses, before anything is allocated, a total that the device has no room for.
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, replace

GIB = 2**30
MIB = 2**20
# This process's CUDA context, cuBLAS and Triton workspaces where NVML cannot measure them (0.5-0.6 GiB
# measured on an H200 with torch 2.11).
CUDA_CONTEXT_BYTES = 640 * MIB
MIN_MARGIN_BYTES = 512 * MIB
MARGIN_FRACTION = 0.02


class MemoryShareError(ValueError):
    """The share (or the explicit KV size) cannot hold this worker; the message gives the figures."""


@dataclass(frozen=True)
class FixedCosts:
    """What the worker holds on the device before its pools (bytes; the module docstring's list, less
    the margin): the same pieces in the plan's inputs and in the plan."""

    weights: int
    non_torch: int
    activations: int
    graphs: int
    transfer: int
    grammar: int
    checkpoints: int

    @property
    def total(self) -> int:
        return sum(asdict(self).values())


@dataclass(frozen=True)
class MemoryInputs:
    """What the plan is made from (bytes). `share`: memory_utilization x the device's total, or None
    when `kv_bytes` (kv_cache_mb) fixes the KV cache instead."""

    device_total: int
    device_free: int  # free on the device now (the other processes' memory already taken)
    held: int  # this process's device memory now (torch reserved + non_torch)
    costs: FixedCosts
    slot_bytes: int  # one recurrent-state slot (0 for models without state)
    max_slots: int  # max_num_seqs (+ the CUDA graphs' scratch slot is added by the plan)
    scratch_slot: bool
    block_bytes: int
    blocks_per_seq: int  # blocks of one max_model_len sequence
    share: int | None = None
    kv_bytes: int | None = None


@dataclass(frozen=True)
class MemoryPlan:
    """The worker's device memory, piece by piece (bytes); `total` is what it may hold at most."""

    share: int | None
    costs: FixedCosts
    margin: int
    state_slots: int  # sequences that may run at once (slots made, the scratch slot not counted)
    state_bytes: int  # all slots, the scratch one included
    num_blocks: int
    kv_bytes: int

    @property
    def total(self) -> int:
        return self.costs.total + self.margin + self.state_bytes + self.kv_bytes

    def pieces(self) -> dict[str, int]:
        """Every piece that adds up to `total`, by name."""
        return {**asdict(self.costs), "state_bytes": self.state_bytes, "kv_bytes": self.kv_bytes,
                "margin": self.margin}  # fmt: skip

    def as_dict(self) -> dict:
        return {"share": self.share, **self.pieces(), "state_slots": self.state_slots,
                "num_blocks": self.num_blocks, "total": self.total}  # fmt: skip

    def describe(self) -> str:
        """One log line: each piece in GiB."""
        head = "share %.2f GiB" % (self.share / GIB) if self.share is not None else "KV fixed by kv_cache_mb"
        parts = ", ".join(f"{k} {v / GIB:.2f}" for k, v in self.pieces().items())
        return (f"device memory plan ({head}): {parts} GiB; {self.state_slots} state slots, "
                f"{self.num_blocks} KV blocks; total {self.total / GIB:.2f} GiB")  # fmt: skip


def margin_bytes(share: int) -> int:
    return max(MIN_MARGIN_BYTES, int(MARGIN_FRACTION * share))


def plan_memory(inp: MemoryInputs) -> MemoryPlan:
    """The pools' sizes for `inp`; MemoryShareError, with the figures, where they cannot fit."""
    costs = inp.costs
    scratch = inp.slot_bytes if inp.scratch_slot else 0
    if inp.share is None:
        return _fixed_kv_plan(inp, scratch)
    share = inp.share
    margin = margin_bytes(share)
    if costs.weights + costs.non_torch > share:
        raise MemoryShareError(
            f"memory_utilization gives this worker {_g(share)} of the device's {_g(inp.device_total)}, "
            f"less than its weights ({_g(costs.weights)}) and CUDA context ({_g(costs.non_torch)}): raise "
            "memory_utilization or run a smaller model"
        )
    if share - inp.held > inp.device_free:
        raise MemoryShareError(
            f"memory_utilization gives this worker {_g(share)} of the device's {_g(inp.device_total)}; it "
            f"holds {_g(inp.held)} and only {_g(inp.device_free)} more are free (other processes hold "
            f"{_g(max(0, inp.device_total - inp.device_free - inp.held))}): lower memory_utilization (the "
            "shares of the workers on one GPU should sum to at most 0.9) or give kv_cache_mb"
        )
    rest = share - costs.total - margin - scratch
    per_seq = inp.slot_bytes + inp.blocks_per_seq * inp.block_bytes
    slots = min(inp.max_slots, rest // per_seq) if inp.slot_bytes and per_seq > 0 else inp.max_slots
    kv = rest - slots * inp.slot_bytes
    num_blocks = kv // inp.block_bytes if inp.block_bytes else 0
    if slots < 1 or num_blocks < inp.blocks_per_seq:
        pieces = ", ".join(f"{k} {_g(v)}" for k, v in asdict(costs).items())
        raise MemoryShareError(
            f"memory_utilization gives this worker {_g(share)} of the device's {_g(inp.device_total)}: "
            f"after {pieces} and a margin of {_g(margin)}, {_g(max(0, rest))} are left, less than one "
            f"sequence of max_model_len needs ({_g(per_seq)}: KV {_g(inp.blocks_per_seq * inp.block_bytes)}"
            f", state {_g(inp.slot_bytes)}): raise memory_utilization, or lower max_num_batched_tokens "
            "(activations) or max_model_len"
        )
    state_bytes = slots * inp.slot_bytes + scratch
    kv_bytes = num_blocks * inp.block_bytes
    return MemoryPlan(share, costs, margin, slots, state_bytes, num_blocks, kv_bytes)


def _fixed_kv_plan(inp: MemoryInputs, scratch: int) -> MemoryPlan:
    assert inp.kv_bytes is not None
    num_blocks = inp.kv_bytes // inp.block_bytes if inp.block_bytes else 0
    state_bytes = inp.max_slots * inp.slot_bytes + scratch
    kv_bytes = num_blocks * inp.block_bytes
    plan = MemoryPlan(None, inp.costs, 0, inp.max_slots, state_bytes, num_blocks, kv_bytes)
    plan = replace(plan, margin=margin_bytes(plan.total))
    if plan.total - inp.held > inp.device_free:
        raise MemoryShareError(
            f"kv_cache_mb {inp.kv_bytes >> 20} makes this worker hold {_g(plan.total)} on the device "
            f"({plan.describe()}); it holds {_g(inp.held)} and only {_g(inp.device_free)} more are free: "
            "lower kv_cache_mb, max_num_seqs or max_num_batched_tokens"
        )
    return plan


def process_device_bytes(device_index: int) -> int | None:
    """This process's device memory on CUDA device `device_index`, as NVML reports it (what nvidia-smi
    shows beside its pid); None without NVML, or where NVML does not list the process (some containers)."""
    try:
        import pynvml
        import torch
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
        uuid = str(torch.cuda.get_device_properties(device_index).uuid)
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith("GPU-") else f"GPU-{uuid}")
        for proc in pynvml.nvmlDeviceGetComputeRunningProcesses(handle):
            if proc.pid == os.getpid() and proc.usedGpuMemory is not None:
                return int(proc.usedGpuMemory)
    except Exception:  # noqa: BLE001 - NVML missing, no permission, a driver without per-process figures
        return None
    return None


def _g(n: int) -> str:
    return f"{n / GIB:.2f} GiB"


__all__ = ["CUDA_CONTEXT_BYTES", "FixedCosts", "MemoryInputs", "MemoryPlan", "MemoryShareError",
           "plan_memory", "process_device_bytes"]  # fmt: skip
