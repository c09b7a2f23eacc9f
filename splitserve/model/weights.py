"""Copying a checkpoint's HF-named tensors into a model whose projections may be merged."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
from torch import nn

from splitserve.model.errors import ModelLoadError

Rows = tuple[int, int] | None
NameMap = Callable[[str], tuple[str | None, Rows]]


def load_mapped_weights(
    model: nn.Module,
    tensors: Iterable[tuple[str, torch.Tensor]],
    map_name: NameMap,
    expected: list[str],
    architecture: str,
) -> None:
    """Copy each tensor to `map_name(name)` = (our parameter, row range in a merged weight or None).

    `expected` lists "param:rows" keys that must all be written; a tensor mapped to None is skipped,
    as is `lm_head.weight` when the model ties it to the embedding.
    """
    params = dict(model.named_parameters())
    tied = getattr(model, "lm_head", None) is None
    loaded: set[str] = set()
    for name, tensor in tensors:
        target, rows = map_name(name)
        if target is None or (target == "lm_head.weight" and tied):
            continue
        if target not in params:
            raise ModelLoadError(f"checkpoint tensor {name!r} has no place in {architecture}")
        dest = params[target].data if rows is None else params[target].data[rows[0] : rows[1]]
        if dest.shape != tensor.shape:
            raise ModelLoadError(
                f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dest.shape)}"
            )
        dest.copy_(tensor)
        loaded.add(f"{target}:{rows}")
    missing = [n for n in expected if n not in loaded]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
