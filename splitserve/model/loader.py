"""Checkpoint -> a ready model on the target device, with a progress bar over the tensors."""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from splitserve.model.checkpoint import Checkpoint, default_model_path, open_checkpoint
from splitserve.model.config import ModelConfig
from splitserve.model.decoder import DecoderLM
from splitserve.model.registry import MODEL_CLASSES, resolve_architecture

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    checkpoint: Checkpoint | None  # None for models built without one (random_weights.py)
    load_seconds: float


def resolve_model_path(model: str | os.PathLike | None) -> str:
    """None or "default" -> the embedded SmolLM2-135M-Instruct GGUF; otherwise the path as given."""
    if model is None or str(model) in ("default", "smollm2-135m-instruct"):
        return str(default_model_path())
    return str(model)


def load_model(
    path: str | os.PathLike,
    device: torch.device,
    dtype: torch.dtype,
    max_positions: Callable[[ModelConfig], int],
    progress: bool = True,
) -> LoadedModel:
    t0 = time.perf_counter()
    ckpt = open_checkpoint(path)
    arch = resolve_architecture(ckpt.hf_config)
    cfg = ModelConfig.from_hf({**ckpt.hf_config, "architectures": [arch]})
    positions = max_positions(cfg)
    with torch.device("meta"):
        model = MODEL_CLASSES[arch](cfg, positions).to(dtype)
    model = model.to_empty(device=device)
    names = ckpt.tensor_names()
    tensors = tqdm(
        ckpt.iter_tensors(), total=len(names), desc="loading weights", unit="tensor", disable=not progress
    )
    model.load_weights(tensors)
    # NOTE: cos/sin are computed, not loaded, and stay fp32 (cast per use, as HF does)
    model.build_rope(positions, device)
    model.eval()
    seconds = time.perf_counter() - t0
    log.info("loaded %s (%s) in %.2fs", path, arch, seconds)
    return LoadedModel(model, cfg, ckpt, seconds)
