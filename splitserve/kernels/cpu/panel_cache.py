"""The decode panels of a model's projections (kernels/cpu/gemm.py `pack`), kept in the weight cache
(model/weight_cache.py) beside the entry of the weights they are packed from: an engine core maps them
(shared pages of the page cache, as the weights are) instead of packing them anew on every start, which
is a copy of every projection (~0.4 s of a core's start for the default model on a 2-core host).

An entry of the panels is a weight cache entry of its own: the same file format, room-making,
locking and checksums. Its key hashes the weights' entry's key (which changes with the checkpoint, the
conversion and splitserve's version), the panel width and this module's revision, and the tensor
table (each panel's name and shape): a change to any of them names another file, and the old one is
evicted as any unused entry. Its CRC32s are checked on the first load after it is written and
whenever the file has changed since (weight_cache_entry.py `verified_before`).

    panels = cached_panels(cache, weights_entry, {"layers.0.attn.qkv_proj": w, ...})  # name -> panels
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from splitserve.kernels.cpu import gemm as cpu_gemm
from splitserve.model.stream import ChecksumMismatch
from splitserve.model.weight_cache import CheckpointInfo, CorruptEntry, Entry, Layout, WeightCache
from splitserve.model.weight_cache_entry import TensorSpec, align_up, map_entry, read_entry, verified_before

log = logging.getLogger(__name__)

REVISION = 1  # bump when `cpu_gemm.pack`'s layout changes


def panel_layout(weights: dict[str, torch.Tensor]) -> Layout:
    """Where each weight's panels ([ceil(N / PANEL), K, PANEL] fp32) go in one flat buffer."""
    specs, offset = [], 0
    for name, w in weights.items():
        n, k = w.shape
        shape = (-(-n // cpu_gemm.PANEL), k, cpu_gemm.PANEL)
        nbytes = shape[0] * k * cpu_gemm.PANEL * 4
        specs.append(TensorSpec(name, torch.float32, shape, offset, nbytes))
        offset = align_up(offset + nbytes)
    return Layout(tuple(specs), offset)


def cached_panels(
    cache: WeightCache, weights_entry: str | Path, weights: dict[str, torch.Tensor]
) -> dict[str, torch.Tensor] | None:
    """{name: panels} for `weights` (fp32 [N, K] each), mapped from the cache entry beside
    `weights_entry` (the entry their model was loaded from), which is written first where there is
    none. None where the cache cannot hold it or it fails its checks twice: the caller packs then."""
    source = Path(weights_entry)
    layout = panel_layout(weights)
    try:  # the weights' entry as it is now: one rebuilt under the same key has another `created`
        footer = read_entry(source).footer
    except (CorruptEntry, OSError) as exc:
        log.warning("weight cache: no panels beside %s (%s); packing them", source.name, exc)
        return None
    origin = f"{footer['key']}/{footer['created']}/panels{cpu_gemm.PANEL}r{REVISION}"
    info = CheckpointInfo(fingerprint=origin, architecture=f"{footer['architecture']}-panels",
                          path=str(source), format="cpu-panels", files=())  # fmt: skip
    key = cache.key(info, layout)
    path = cache.entry_path(key, info, layout)
    for _ in range(2):
        try:
            entry, built = _find_or_build(cache, path, key, info, layout, weights)
            if entry is None:
                return None
            verify = cache.verify and not built and not verified_before(path)
            tensors = map_entry(entry, verify)
        except (ChecksumMismatch, CorruptEntry) as exc:
            log.warning("weight cache: the panels %s are corrupt (%s); rebuilding them", path.name, exc)
            cache.remove(path)
            continue
        except OSError as exc:
            log.warning("weight cache: the panels %s cannot be read (%s); packing them", path.name, exc)
            return None
        cache.touch(entry)
        return tensors
    return None


def _find_or_build(
    cache: WeightCache, path: Path, key: str, info: CheckpointInfo, layout: Layout,
    weights: dict[str, torch.Tensor],
) -> tuple[Entry | None, bool]:  # fmt: skip
    """-> (the entry or None where it cannot be written, whether it was written now)."""
    entry, found = cache.lookup(path, key, info, layout)
    if entry is not None:
        return entry, False
    with cache.lock(path):
        entry, found = cache.lookup(path, key, info, layout)
        if entry is not None:  # another core wrote it while we waited for the lock
            return entry, False
        if not found.startswith("miss"):
            log.warning("weight cache: the panels %s are %s; rebuilding them", path.name, found)
            cache.remove(path)

        def fill(data: torch.Tensor) -> None:
            views = layout.views(data)
            for name, w in weights.items():
                views[name].copy_(cpu_gemm.pack(w))

        return cache.build(path, key, info, layout, fill, {}), True


__all__ = ["REVISION", "cached_panels", "panel_layout"]
