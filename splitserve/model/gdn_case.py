"""One Gated DeltaNet layer of the small Qwen3.5 (`SMALL_QWEN3_5`) with random weights, its state slots
and a mixed batch (decode rows, then prefill chunks of several lengths): the case on which the varlen
fla rule is held against the torch rule (tests/gpu/test_gdn_fla.py) and against fp64
(bench/gdn_fla_precision.py)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from splitserve.model import gdn_layer
from splitserve.model.attention import AttentionMetadata, PrefillChunk
from splitserve.model.config import ModelConfig
from splitserve.model.random_weights import SMALL_QWEN3_5

PROMPT_LENS = (1, 2, 9, 70, 130)  # prefill chunks: within one fla chunk of 64, across one, across two
DECODE_ROWS = 3
STATE_SLOTS = 9


@dataclass
class GdnCase:
    layer: gdn_layer.GatedDeltaNet
    states: dict[str, torch.Tensor]  # "conv", "recurrent": [STATE_SLOTS, 3, ...] (layer index 1 of 3)
    meta: AttentionMetadata
    x: torch.Tensor  # [DECODE_ROWS + sum(PROMPT_LENS), hidden]


def gdn_layer_case(device: str | torch.device) -> GdnCase:
    """The case on `device`, the same for every call (seeded); weights and states ~ N(0, 0.2)."""
    cfg = ModelConfig.from_hf(
        {**SMALL_QWEN3_5, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
    )
    torch.manual_seed(0)
    layer = gdn_layer.GatedDeltaNet(cfg, 1).to(device).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    lin = cfg.linear
    assert lin is not None
    heads = (lin.num_value_heads, lin.key_head_dim, lin.value_head_dim)
    states = {
        "conv": torch.randn(STATE_SLOTS, 3, lin.conv_dim, lin.conv_kernel - 1, device=device) * 0.2,
        "recurrent": torch.randn(STATE_SLOTS, 3, *heads, device=device) * 0.2,
    }
    chunks, start = [], DECODE_ROWS
    for n in PROMPT_LENS:
        chunks.append(PrefillChunk(start, n, n, None))
        start += n
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(start, dtype=torch.int64, device=device),
        num_decode_tokens=DECODE_ROWS,
        decode_groups=(),
        prefills=tuple(chunks),
        seq_slots=torch.tensor([6, 1, 3, 0, 7, 4, 8, 2], device=device),
    )
    x = torch.randn(start, cfg.hidden_size, device=device)
    return GdnCase(layer, states, meta, x)


__all__ = ["DECODE_ROWS", "PROMPT_LENS", "GdnCase", "gdn_layer_case"]
