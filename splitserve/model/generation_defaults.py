"""A checkpoint's own sampling defaults, for the requests that set none (vLLM's `--generation-config`).

    generation_defaults("auto", "/models/qwen3")   # {"temperature": 0.6, "top_p": 0.95, "top_k": 20}

`setting` (the manifest's `model.generation_config`): "auto" reads the checkpoint's (an HF directory's
`generation_config.json`; a GGUF file's `general.sampling.*` metadata, as llama.cpp writes it, through
the header memo the weight cache keeps); "vllm" ignores it (a request's unset fields take the OpenAI
defaults: temperature 1, top_p 1); a folder reads that folder's `generation_config.json`. Only the
sampling fields vLLM takes are used: temperature, top_p, top_k, min_p, repetition_penalty. A field
the request sets always wins. No torch or gguf here: the router calls it.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
# llama.cpp's GGUF keys (`general.sampling.*`) -> the request's field
GGUF_FIELDS = {"temp": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
               "penalty_repeat": "repetition_penalty"}  # fmt: skip
GGUF_CONFIG_KEY = "splitserve_generation_defaults"  # where open_gguf keeps them in the HF-style config


def generation_defaults(setting: str, model: str | None) -> tuple[dict[str, float | int], str]:
    """-> (the defaults, where they came from) for `model` (a checkpoint path, or a `random:` name)."""
    if setting == "vllm":
        return {}, "none (generation_config: vllm)"
    folder = Path(setting) if setting != "auto" else Path(model) if model else None
    if folder is None or str(model or "").startswith("random:") and setting == "auto":
        return {}, "none (random weights)"
    if folder.is_dir():
        file = folder / "generation_config.json"
        if not file.exists():
            return {}, f"none ({folder} has no generation_config.json)"
        return _pick(json.loads(file.read_text(encoding="utf-8"))), str(file)
    if folder.is_file() and folder.suffix.lower() == ".gguf":
        found = _gguf_defaults(folder)
        return found, f"{folder.name}'s general.sampling metadata" if found else f"none ({folder.name})"
    return {}, f"none ({folder} is not a checkpoint)"


def gguf_sampling(fields: dict[str, Any]) -> dict[str, float | int]:
    """The defaults among a GGUF's metadata values (`{"general.sampling.temp": 0.7, ...}`)."""
    picked = {f: fields.get(f"general.sampling.{key}") for key, f in GGUF_FIELDS.items()}
    return _pick(picked)


def _pick(config: dict[str, Any]) -> dict[str, float | int]:
    out: dict[str, float | int] = {}
    for key in FIELDS:
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float):
            continue
        out[key] = int(value) if key == "top_k" else float(value)
    return out


def _gguf_defaults(path: Path) -> dict[str, float | int]:
    """From the header memo (written when a worker opened the file); {} without one."""
    from splitserve.model.checkpoint_memo import cache_root, memo_file, signature

    try:
        data = json.loads(memo_file(path, cache_root() / "weights").read_text(encoding="utf-8"))
        if data["sig"] == signature(path):
            return dict(data["hf_config"].get(GGUF_CONFIG_KEY) or {})
    except (OSError, ValueError, KeyError, TypeError):
        log.info("no header memo for %s: its sampling metadata is not read", path)
    return {}


def describe(defaults: dict[str, float | int], source: str) -> str:
    """The log line: what a request that sets none of these fields gets."""
    if not defaults:
        return f"generation defaults: {source}; a request's unset fields take temperature 1, top_p 1"
    shown = ", ".join(f"{k}={v:g}" for k, v in defaults.items())
    return f"generation defaults from {source}: {shown} (for the fields a request does not set)"


__all__ = ["FIELDS", "GGUF_CONFIG_KEY", "describe", "generation_defaults", "gguf_sampling"]
