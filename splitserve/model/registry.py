"""Architecture registry: a checkpoint's `architectures` (or `model_type`) -> the class that runs it.

The list of supported families lives in `checkpoint.SUPPORTED_ARCHITECTURES` (checked when a
checkpoint is opened); this module maps each to its implementation.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from splitserve.model.checkpoint import MODEL_TYPE_TO_ARCHITECTURE, SUPPORTED_ARCHITECTURES
from splitserve.model.decoder import DecoderLM
from splitserve.model.errors import ModelLoadError
from splitserve.model.qwen3_5 import Qwen3_5LM

_HYBRID: dict[str, type[nn.Module]] = {
    "Qwen3_5ForCausalLM": Qwen3_5LM,
    "Qwen3_5ForConditionalGeneration": Qwen3_5LM,
}
MODEL_CLASSES: dict[str, type[nn.Module]] = {
    arch: _HYBRID.get(arch, DecoderLM) for arch in SUPPORTED_ARCHITECTURES
}


def resolve_architecture(hf_config: dict[str, Any]) -> str:
    """The registry key for a config, from `architectures` first, then `model_type`."""
    for arch in hf_config.get("architectures") or []:
        if arch in MODEL_CLASSES:
            return arch
    arch = MODEL_TYPE_TO_ARCHITECTURE.get(hf_config.get("model_type", ""))
    if arch in MODEL_CLASSES:
        return arch
    raise ModelLoadError(
        f"unsupported architecture {hf_config.get('architectures')} "
        f"(model_type {hf_config.get('model_type')!r}); supported: {', '.join(MODEL_CLASSES)}"
    )
