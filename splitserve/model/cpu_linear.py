"""CPU projections through oneDNN with weights packed once at start-up.

On this repo's CPU machines (AMD EPYC, AVX-512) `F.linear` goes to MKL, which runs its AVX2 kernels on
AMD processors and reads a cold fp32 weight at about half the memory bandwidth at batch 1, and far below
it at batch 4-32 (`bench/cpu_engine.py` prints both). oneDNN's matmul over a weight reordered into its
blocked layout (what vLLM-CPU does) uses AVX-512 on any vendor: the decode step's projections and the LM
head run about 2x faster at batch 1 and 2.5x at batch 32, prefill's about 2x.

The packed weight is an opaque oneDNN tensor kept beside the module's dense weight (`Linear.packed`,
`DecoderLM.packed_lm_head`), so anything that reads the dense weights (the embedding, HF exports, the
weight cache) still sees them; the cost is one more copy of the projection weights in host memory.
oneDNN sums in another order than MKL: logits differ from `F.linear`'s by ~1e-5 relative, and greedy
output stays token-exact with HF on the parity tests (`tests/engine/test_hf_parity.py`).

`SPLITSERVE_CPU_ONEDNN=0` in the environment leaves every projection on `F.linear` (an A/B switch).
"""

from __future__ import annotations

import os

import torch
from torch import nn

ENABLED = os.environ.get("SPLITSERVE_CPU_ONEDNN", "1") != "0"


def available(dtype: torch.dtype) -> bool:
    """Whether torch was built with oneDNN and it packs `dtype` here (fp32 only: bf16 is not token-exact)."""
    return dtype == torch.float32 and torch.backends.mkldnn.is_available()


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] dense -> the same weight in oneDNN's blocked layout (an opaque mkldnn tensor)."""
    with torch.no_grad():
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous())


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """F.linear(x, W, bias) with W packed by `pack`. x [..., in] -> [..., out]."""
    if x.dim() == 2:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    out = torch.ops.mkldnn._linear_pointwise(x.reshape(-1, x.shape[-1]), packed, bias, "none", [], "")
    return out.view(*x.shape[:-1], out.shape[-1])


def pack_model(model: nn.Module) -> int:
    """Pack every `Linear` of a CPU fp32 model, and a decoder's LM head; -> how many weights were packed
    (0 when off, on another device or dtype)."""
    from splitserve.model.layers import Linear

    if not ENABLED:
        return 0
    count = 0
    for module in model.modules():
        weight = getattr(module, "weight", None)
        if isinstance(module, Linear) and weight.device.type == "cpu" and available(weight.dtype):
            module.packed = pack(module.weight)
            count += 1
    head = _lm_head_weight(model)
    if head is not None and head.device.type == "cpu" and available(head.dtype):
        model.packed_lm_head = pack(head)
        count += 1
    return count


def unpack_model(model: nn.Module) -> None:
    """Back to `F.linear` everywhere (the benches' A/B in one process)."""
    for module in model.modules():
        if getattr(module, "packed", None) is not None:
            module.packed = None
    if getattr(model, "packed_lm_head", None) is not None:
        model.packed_lm_head = None


def _lm_head_weight(model: nn.Module) -> torch.Tensor | None:
    if not hasattr(model, "packed_lm_head"):
        return None  # a model whose compute_logits does not read a packed head
    lm_head = getattr(model, "lm_head", None)
    return model.embed_tokens.weight if lm_head is None else lm_head.weight
