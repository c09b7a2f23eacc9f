"""Checkpoint -> a ready model on the target device, timed stage by stage.

Three ways in, fastest first:

* ``cache-mmap`` / ``cache-stream``: a host-side weight cache entry (``weight_cache.py``) holds the
  final parameters as one flat file; the CPU maps it (zero-copy, shared with other workers), an
  accelerator gets it through large pinned chunks into one device buffer. A miss builds the entry
  first (read + convert into the new file), then loads it the same way.
* ``direct-stream`` (safetensors): tensors whose stored dtype is the target dtype go from the files
  to their places in one flat buffer (merged q/k/v and gate/up rows included) by reader threads in
  large reads (CPU: straight into the buffer; accelerator: through pinned chunks), with no
  per-tensor host copies; any others are converted one at a time. A cache miss fills the new
  entry the same way.
* ``per-tensor``: every tensor read (GGUF: dequantized), converted and copied on its own.

`LoadedModel.load_stats` says which way was taken and how long each stage took (seconds, a JSON-ready
dict); the same is logged at INFO.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from splitserve.model.checkpoint import Checkpoint, default_model_path, open_checkpoint
from splitserve.model.config import ModelConfig
from splitserve.model.decoder import DecoderLM
from splitserve.model.errors import ModelLoadError
from splitserve.model.registry import MODEL_CLASSES, resolve_architecture
from splitserve.model.stream import ChecksumMismatch, plan_chunks, stream_to_device
from splitserve.model.weight_cache import (
    CheckpointInfo,
    Entry,
    Layout,
    WeightCache,
    assign_parameters,
    dtype_name,
    map_entry,
    open_checkpoint_memo,
    stream_entry,
)
from splitserve.model.weight_cache_entry import verified_before
from splitserve.model.weights import load_mapped_weights

log = logging.getLogger(__name__)

#: Tests set these: stream cache entries on CPU too (the accelerator path), or never stream
#: straight from a checkpoint (the per-tensor path).
_CPU_STREAM = False
_DIRECT = True

#: Load stages, in order; `load_stats["seconds"]` has those that ran.
#: open: parse the checkpoint, fingerprint it, build the model skeleton, look up the cache.
#: device_init: create the CUDA context. read: checkpoint bytes into memory (GGUF: the quantized
#: blocks). convert: dequantize, reorder, cast and merge into the model's layout (on a cache miss:
#: into the new entry). cache_write: checksums, footer, atomic rename. verify: CPU cache hit, CRC of
#: every chunk (this also pages the mapping in). copy: host -> device (streams: file -> pinned ->
#: device, with reads and CRCs overlapped; see `load_stats["cache_stream"]`). warmup: rotary tables,
#: one LM-head matmul (cuBLAS init), device sync.
STAGES = ("open", "device_init", "read", "convert", "cache_write", "verify", "copy", "warmup")


@dataclass(frozen=True)
class LoadedModel:
    model: DecoderLM
    config: ModelConfig
    checkpoint: Checkpoint | None  # None for models built without one (random_weights.py)
    load_seconds: float
    #: how the weights were loaded and how long each stage took (see `load_model`); JSON-ready
    load_stats: dict[str, Any] = field(default_factory=dict)


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
    weight_cache: WeightCache | None = None,
    threads: int | None = None,
) -> LoadedModel:
    """Load a checkpoint onto ``device`` in ``dtype``, through ``weight_cache`` when one is given.

    ``threads``: reader threads for streamed loads and checksums (default min(16, cores)).

    ``load_stats`` keys: ``total_seconds``; ``seconds`` (per stage, see ``STAGES``); ``bytes`` (the
    parameters in ``dtype``) and ``gb_per_s`` (bytes / total); ``method`` (cache-mmap, cache-stream,
    direct-stream or per-tensor); ``cache`` (``status``: off, hit, miss, stale, corrupt, skipped or error;
    ``built``, ``verified``, ``path``, ``detail``); ``checkpoint_stream`` / ``cache_stream`` (reader
    statistics of a streamed load from the checkpoint / the cache entry);
    ``device``, ``dtype``, ``checkpoint_format``, ``checkpoint_bytes``.
    """
    t0 = time.perf_counter()
    device = torch.device(device)
    timings: dict[str, float] = {}
    stats: dict[str, Any] = {"device": str(device), "dtype": dtype_name(dtype)}
    with _timed(timings, "open"):
        if weight_cache is not None:
            ckpt = open_checkpoint_memo(path, weight_cache.directory)
        else:
            ckpt = open_checkpoint(path)
        arch = resolve_architecture(ckpt.hf_config)
        cfg = ModelConfig.from_hf({**ckpt.hf_config, "architectures": [arch]})
        positions = max_positions(cfg)
        with torch.device("meta"), skip_init():
            model = MODEL_CLASSES[arch](cfg, positions).to(dtype)
        layout = Layout.of(model)
        info = None
        if weight_cache is not None:
            info = CheckpointInfo(ckpt.fingerprint(), arch, str(ckpt.path), ckpt.format, tuple(ckpt.files()))
    stats["checkpoint_format"] = ckpt.format
    stats["checkpoint_bytes"] = sum(f.stat().st_size for f in ckpt.files())
    if device.type == "cuda":
        with _timed(timings, "device_init"):
            torch.cuda.init()
            torch.empty(1, device=device)
            torch.cuda.synchronize(device)
    loader = _Loader(ckpt, model, layout, device, timings, stats, progress, threads)
    stats["cache"] = {"status": "off"}
    method = None
    if weight_cache is not None and info is not None:
        try:
            method = loader.via_cache(weight_cache, info)
        except OSError as exc:  # an unwritable or full cache directory must not stop the load
            log.warning("weight cache %s unusable (%s); loading without it", weight_cache.directory, exc)
            stats["cache"] = {"status": "error", "detail": str(exc), "built": False, "verified": False}
    if method is None:
        method = loader.direct()
    stats["method"] = method
    with _timed(timings, "warmup"):
        _warm_up(model, cfg, positions, device, dtype)
    total = time.perf_counter() - t0
    stats["total_seconds"] = round(total, 4)
    stats["seconds"] = {k: round(timings[k], 4) for k in STAGES if k in timings}
    stats["bytes"] = layout.data_bytes
    stats["gb_per_s"] = round(layout.data_bytes / total / 1e9, 3) if total > 0 else None
    log.info("loaded %s (%s) in %.2fs: %s", path, arch, total, describe_load(stats))
    return LoadedModel(model, cfg, ckpt, total, stats)


def describe_load(stats: dict[str, Any]) -> str:
    """One line: method, GB and GB/s, per-stage seconds, cache status."""
    stages = ", ".join(f"{k} {v:.2f}" for k, v in stats.get("seconds", {}).items())
    cache = stats.get("cache", {})
    status = cache.get("status", "off")
    if cache.get("built"):
        status += ", built"
    if cache.get("path"):
        status += f" ({cache['path']})"
    return (
        f"{stats.get('method')} {stats.get('bytes', 0) / 1e9:.2f} GB at {stats.get('gb_per_s')} GB/s "
        f"[{stages}]; weight cache: {status}"
    )


_INIT_FUNCTIONS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
)


@contextlib.contextmanager
def skip_init() -> Iterator[None]:
    """Make `torch.nn.init`'s in-place initializers no-ops while a skeleton is built on `meta`.

    Initializing meta tensors does nothing anyway, but `normal_` on meta imports PyTorch's Python
    meta kernels (and sympy) on first use: a second or more of every cold process start.
    """
    saved = {name: getattr(nn.init, name) for name in _INIT_FUNCTIONS if hasattr(nn.init, name)}
    try:
        for name in saved:
            setattr(nn.init, name, _no_init)
        yield
    finally:
        for name, fn in saved.items():
            setattr(nn.init, name, fn)


def _no_init(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def _timed(timings: dict[str, float], key: str) -> Iterator[None]:
    t = time.perf_counter()
    try:
        yield
    finally:
        timings[key] = timings.get(key, 0.0) + time.perf_counter() - t


class _Loader:
    def __init__(
        self,
        ckpt: Checkpoint,
        model: nn.Module,
        layout: Layout,
        device: torch.device,
        timings: dict[str, float],
        stats: dict[str, Any],
        progress: bool,
        threads: int | None,
    ) -> None:
        self.ckpt, self.model, self.layout, self.device = ckpt, model, layout, device
        self.timings, self.stats, self.progress, self.threads = timings, stats, progress, threads

    # -- through the cache

    def via_cache(self, cache: WeightCache, info: CheckpointInfo) -> str | None:
        """Load through ``cache`` (building the entry on a miss); None if the entry cannot be stored."""
        with _timed(self.timings, "open"):
            key = cache.key(info, self.layout)
            path = cache.entry_path(key, info, self.layout)
            entry, found = cache.lookup(path, key, info, self.layout)
        status, _, detail = found.partition(": ")
        report: dict[str, Any] = {"status": status, "path": str(path), "built": False, "verified": False}
        if detail:
            report["detail"] = detail
        self.stats["cache"] = report
        if entry is None and status != "miss":
            log.warning("weight cache: %s is %s; rebuilding it", path.name, found)
        for _ in range(2):
            if entry is None:
                entry = self._build(cache, path, key, info, report)
                if entry is None:
                    report["status"] = "skipped"
                    return None
            verify = cache.verify and not report["built"] and not verified_before(entry.path)
            try:
                tensors, method = self._materialize(entry, verify)
            except ChecksumMismatch as exc:
                log.warning("weight cache: %s is corrupt (%s); rebuilding it", path.name, exc)
                report.update(status="corrupt", detail=str(exc))
                cache.remove(path)
                entry = None
                continue
            report["verified"] = verify
            assign_parameters(self.model, tensors)
            cache.touch(entry)
            return method
        raise ModelLoadError(f"weight cache entry {path} failed its checksum right after being rebuilt")

    def _build(
        self, cache: WeightCache, path: Path, key: str, info: CheckpointInfo, report: dict[str, Any]
    ) -> Entry | None:
        with cache.lock(path):
            entry, found = cache.lookup(path, key, info, self.layout)
            if entry is not None:  # another process built it while we waited for the lock
                return entry
            if not found.startswith("miss"):
                cache.remove(path)
            entry = cache.build(path, key, info, self.layout, self._fill, self.timings)
            report["built"] = entry is not None
            return entry

    def _fill(self, data: torch.Tensor) -> None:
        """Convert the checkpoint into CPU parameters backed by the new cache entry."""
        self._from_checkpoint(data, "caching weights")

    def _materialize(self, entry: Entry, verify: bool) -> tuple[dict[str, torch.Tensor], str]:
        if self.device.type == "cpu" and not _CPU_STREAM:
            with _timed(self.timings, "verify" if verify else "read"):
                return map_entry(entry, verify, self.threads), "cache-mmap"
        with _timed(self.timings, "copy"):
            tensors, sstats = stream_entry(entry, self.device, verify, self.progress, self.threads)
        self.stats["cache_stream"] = sstats.as_dict()
        return tensors, "cache-stream"

    # -- straight from the checkpoint

    def direct(self) -> str:
        dest = torch.empty(self.layout.data_bytes, dtype=torch.uint8, device=self.device)
        return self._from_checkpoint(dest, "weights from checkpoint")

    def _from_checkpoint(self, dest: torch.Tensor, desc: str) -> str:
        """Fill the flat buffer ``dest`` (on any device) from the checkpoint, its parameters viewing it.

        Tensors stored in their parameter's dtype are streamed straight to their offsets (reader
        threads, large reads, no per-tensor host copies); the others are converted one at a time.
        (Not `to_empty`: meta -> device `empty_like` imports PyTorch's Python refs, a second or more.)
        """
        model = self.model
        assign_parameters(model, self.layout.views(dest))
        plan = _direct_plan(self.ckpt, model, self.layout) if _DIRECT else None
        rest = "convert" if dest.device.type == "cpu" else "copy"
        if plan is None:
            self._load_tensors(self.ckpt.iter_tensors(timings=self.timings), rest)
            return "per-tensor"
        pieces, leftovers = plan
        with _timed(self.timings, "read" if dest.device.type == "cpu" else "copy"):
            sstats = stream_to_device(plan_chunks(pieces), dest, self.threads, self.progress, desc=desc)
        self.stats["checkpoint_stream"] = sstats.as_dict()
        if leftovers:  # tensors stored in another dtype: cast one at a time
            names = [name for name, _ in leftovers]
            tensors = self.ckpt.iter_tensors(names=names, timings=self.timings)
            t = time.perf_counter()
            read0 = self.timings.get("read", 0.0)
            load_mapped_weights(
                model, tensors, model.map_weight_name, [k for _, k in leftovers], "checkpoint"
            )
            spent = time.perf_counter() - t - (self.timings.get("read", 0.0) - read0)
            self.timings[rest] = self.timings.get(rest, 0.0) + spent
        return "direct-stream"

    def _load_tensors(self, tensors: Iterator[tuple[str, torch.Tensor]], rest: str) -> None:
        """model.load_weights over ``tensors``; time not spent in the source goes to ``rest``."""
        before = self.timings.get("read", 0.0) + self.timings.get("convert", 0.0)
        t = time.perf_counter()
        names = self.ckpt.tensor_names()
        bar = tqdm(
            tensors, total=len(names), desc="loading weights", unit="tensor", disable=not self.progress
        )
        self.model.load_weights(bar)
        in_source = self.timings.get("read", 0.0) + self.timings.get("convert", 0.0) - before
        self.timings[rest] = self.timings.get(rest, 0.0) + time.perf_counter() - t - in_source


def _direct_plan(
    ckpt: Checkpoint, model: nn.Module, layout: Layout
) -> tuple[list[tuple[str, int, int, int]], list[tuple[str, str]]] | None:
    """(pieces, leftovers): byte ranges of the checkpoint's files -> offsets in the layout's flat
    buffer for every tensor stored in its parameter's dtype, and (name, "param:rows") of the others.
    None for formats that need decoding, or when nothing can be streamed."""
    locations = ckpt.tensor_locations()
    if locations is None:
        return None
    specs = layout.by_name()
    tied = getattr(model, "lm_head", None) is None
    pieces: list[tuple[str, int, int, int]] = []
    leftovers: list[tuple[str, str]] = []
    covered: set[str] = set()
    for loc in locations:
        target, rows = model.map_weight_name(loc.name)
        if target is None or (target == "lm_head.weight" and tied):
            continue
        spec = specs.get(target)
        if spec is None:
            raise ModelLoadError(f"checkpoint tensor {loc.name!r} has no place in {type(model).__name__}")
        shape = spec.shape if rows is None else (rows[1] - rows[0], *spec.shape[1:])
        if loc.shape != shape:
            raise ModelLoadError(f"checkpoint tensor {loc.name!r} has shape {loc.shape}, expected {shape}")
        key = f"{target}:{rows}"
        covered.add(key)
        if loc.dtype != spec.dtype:
            leftovers.append((loc.name, key))
            continue
        row_bytes = math.prod(spec.shape[1:]) * spec.dtype.itemsize
        start = spec.offset + (rows[0] * row_bytes if rows is not None else 0)
        pieces.append((str(loc.path), loc.offset, loc.nbytes, start))
    missing = [k for k in model.expected_weight_keys() if k not in covered]
    if missing:
        raise ModelLoadError(f"checkpoint is missing {len(missing)} tensors, e.g. {missing[:3]}")
    return (pieces, leftovers) if pieces else None


def _warm_up(
    model: nn.Module, cfg: ModelConfig, positions: int, device: torch.device, dtype: torch.dtype
) -> None:
    # NOTE: cos/sin are computed, not loaded, and stay fp32 (cast per use, as HF does)
    model.build_rope(positions, device)
    model.eval()
    unset = [n for n, t in itertools.chain(model.named_parameters(), model.named_buffers()) if t.is_meta]
    if unset:
        raise ModelLoadError(f"{len(unset)} model tensors were never loaded, e.g. {unset[:3]}")
    with torch.inference_mode():  # one LM-head matmul: cuBLAS handles and kernels are ready
        model.compute_logits(torch.zeros(1, cfg.hidden_size, dtype=dtype, device=device))
    if device.type == "cuda":
        torch.cuda.synchronize(device)
