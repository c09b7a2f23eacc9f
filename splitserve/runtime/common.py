"""What a worker of a pool gets from the manifest: its command line (local runtime) or its config
(the Ray runtime builds the worker in its replica process); and what /workers shows of a worker of
either runtime (`describe_worker`)."""

from __future__ import annotations

import dataclasses
import os
import sys
from typing import TYPE_CHECKING, Any, Protocol

from splitserve.config.manifest import Manifest

if TYPE_CHECKING:
    from splitserve.config.worker import WorkerConfig
    from splitserve.wire.stats import Health


def pool_device(manifest: Manifest, role: str, index: int) -> str:
    pool = manifest.pools()[role]
    return pool.devices[index % len(pool.devices)] if pool.devices else manifest.model.device


def worker_argv(
    manifest: Manifest, role: str, index: int, secret_env: str, core_share: str | None = None
) -> list[str]:
    """The command line of one worker: its `worker_config` as JSON (`--spec`, no secret), then
    `runtime.worker_args` (flags given beside the spec override its fields). Every role gets the
    deployment's secret in the environment variable `secret_env`: it keys the KV handshake and the
    worker API's token. `core_share`: the local runtime's file of lent cores (`lending_slots`).
    With `runtime.pin_cores`, the worker is pinned to its share of this host's CPUs (`pinned_cpus`)."""
    config = worker_config(manifest, role, index, "-", "127.0.0.1", core_share)
    cpus = pinned_cpus(manifest).get((role, index))
    if cpus:
        threads = manifest.engine_for(role).threads or len(cpus)
        config = dataclasses.replace(config, cpus=cpus, threads=threads)
    return config_argv(manifest, config, secret_env)


def config_argv(manifest: Manifest, config: WorkerConfig, secret_env: str) -> list[str]:
    """A worker's command line for `config` (see `worker_argv`)."""
    spec = config.to_json(include_secret=False)
    argv = [sys.executable, "-m", "splitserve.worker.main", "--spec", spec, "--kv-secret-env", secret_env,
            "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    return argv + list(manifest.runtime.worker_args)


def worker_config(
    manifest: Manifest, role: str, index: int, secret: str | None, host: str, core_share: str | None = None
) -> WorkerConfig:
    """One worker's config from the manifest (its engine from `engine_for(role)`): what the local
    runtime hands a worker process as `--spec` and the Ray runtime builds its replica's worker from.
    `secret`: the deployment's (None: no worker API auth). `core_share`: see `worker_argv`."""
    from splitserve.config.engine import EngineConfig
    from splitserve.config.worker import WorkerConfig

    m, e, t = manifest.model, manifest.engine_for(role), manifest.transport
    engine = EngineConfig(
        model=None if m.source == "default" else m.source,
        tokenizer=m.tokenizer,
        device=pool_device(manifest, role, index),
        dtype=m.dtype,
        block_size=e.block_size,
        max_model_len=m.max_model_len,
        max_num_seqs=e.max_num_seqs,
        max_num_batched_tokens=e.max_num_batched_tokens,
        kv_cache_bytes=None if e.kv_cache_mb is None else e.kv_cache_mb << 20,
        **({} if e.memory_utilization is None else {"gpu_memory_utilization": e.memory_utilization}),
        seed=e.seed,
        weight_cache_dir=e.weight_cache_dir,
        weight_cache_max_gb=e.weight_cache_max_gb,
        weight_cache_verify=e.weight_cache_verify,
        enforce_eager=e.enforce_eager,
        enable_prefix_caching=e.enable_prefix_caching,
        async_scheduling=e.async_scheduling,
        cpu_weights=e.cpu_weights,
        grammar_threads=manifest.server.structured.compile_threads,
        grammar_timeout_s=manifest.server.structured.compile_timeout_s,
        speculative_config=e.speculative_config,
        tensor_parallel_size=manifest.tensor_parallel_size(role),
        progress=False,
    )
    return WorkerConfig(
        role=role,
        engine=engine,
        served_name=m.resolved_served_name(),
        kv_backend=t.backend,
        kv_fallback=tuple(t.fallback),
        kv_nixl_backends=tuple(t.nixl_backends),
        kv_secret=secret,
        http_auth=secret is not None,
        kv_host=host,
        kv_lease_s=t.lease_s,
        kv_fetch_timeout_s=t.fetch_timeout_s,
        kv_policy=t.policy,
        kv_checksum=t.checksum,
        kv_state_dtype=t.state_dtype,
        kv_state_rows=t.state_rows,
        threads=e.threads if e.threads is not None else cpu_threads(manifest),
        stream_interval=manifest.server.stream_interval,
        **_lending(manifest, role, index, core_share),
    )


def cpu_workers(manifest: Manifest) -> list[tuple[str, int]]:
    """(role, index) of the deployment's workers that are not on a GPU, in pool order."""
    return [
        (role, i)
        for role, pool in manifest.pools().items()
        for i in range(pool.replicas)
        if not pool_device(manifest, role, i).startswith("cuda")
    ]


def lending_slots(manifest: Manifest) -> dict[tuple[str, int], int]:
    """The CPU workers that lend each other idle cores (core/share.py), each with its slot: those
    whose threads the manifest leaves to the runtime (`cpu_threads`), when there are two or more,
    `runtime.lend_cores` is on and `runtime.pin_cores` off."""
    if not manifest.runtime.lend_cores or manifest.runtime.pin_cores:
        return {}
    lenders = [(r, i) for r, i in cpu_workers(manifest) if manifest.engine_for(r).threads is None]
    lenders = [(r, i) for r, i in lenders if manifest.tensor_parallel_size(r) == 1]  # one process each
    return {w: slot for slot, w in enumerate(lenders)} if len(lenders) > 1 else {}


def pinned_cpus(manifest: Manifest) -> dict[tuple[str, int], tuple[int, ...]]:
    """With `runtime.pin_cores`: each single-process CPU worker's own CPUs, this host's split evenly
    among them in pool order (core/pinning.py); else nothing is pinned."""
    from splitserve.core.pinning import host_cpus, split_cpus

    if not manifest.runtime.pin_cores:
        return {}
    workers = [(r, i) for r, i in cpu_workers(manifest) if manifest.tensor_parallel_size(r) == 1]
    return dict(zip(workers, split_cpus(host_cpus(), len(workers)), strict=True))


def core_share_file(manifest: Manifest) -> str | None:
    """The local runtime's file through which its CPU workers lend idle cores (core/share.py), in
    a fresh 0700 folder; None when fewer than two workers lend."""
    from splitserve.core import share as core_share
    from splitserve.tempdirs import owned_tempdir

    slots = lending_slots(manifest)
    if not slots:
        return None
    path = os.path.join(owned_tempdir(core_share.CORES_PREFIX), "cores")
    core_share.create(path, len(slots))
    return path


def _lending(manifest: Manifest, role: str, index: int, core_share: str | None) -> dict:
    slot = lending_slots(manifest).get((role, index)) if core_share else None
    if slot is None:
        return {}
    pace_ms = manifest.runtime.decode_pace_ms
    pace_ms = manifest.slos.itl_ms if pace_ms is None else pace_ms
    return {"core_share": core_share, "core_slot": slot, "core_total": os.cpu_count() or 1,
            "decode_pace_s": pace_ms / 1e3 if role == "decode" else 0.0}  # fmt: skip


def cpu_threads(manifest: Manifest) -> int:
    """A CPU worker's intra-op threads when the manifest leaves them out: this host's cores shared
    evenly among the deployment's workers that are not on a GPU (colocated on 2 cores: 2; a prefill
    and a decode worker: 1 each)."""
    ranks = sum(manifest.tensor_parallel_size(role) for role, _ in cpu_workers(manifest))
    return max(1, (os.cpu_count() or 1) // max(1, ranks))


class WorkerView(Protocol):
    """What both runtimes know of a worker (local.WorkerProcess, ray_workers.RayEndpoint)."""

    name: str
    role: str
    state: str
    url: str | None
    kv_address: str | None
    info: dict
    health: Health | None  # the last /health (or ready line), decoded
    restarts: int
    inflight: int
    startup_s: float | None  # the last spawn -> ready time, where the runtime measures it
    last_exit: int | None

    @property
    def pid(self) -> int | None: ...


def describe_worker(w: WorkerView, **extra: Any) -> dict:
    """One worker as /workers shows it; `extra`: the runtime's own fields (Ray: node_id)."""
    return {
        "name": w.name,
        "role": w.role,
        "state": w.state,
        "url": w.url,
        "pid": w.pid,
        "restarts": w.restarts,
        "startup_s": None if w.startup_s is None else round(w.startup_s, 3),
        "last_exit": w.last_exit,
        "inflight": w.inflight,
        "kv_backend": w.health.kv_backend if w.health is not None else None,
        "kv_address": w.kv_address,
        **extra,
        "info": dict(w.info),
    }


__all__ = [
    "WorkerView",
    "config_argv",
    "core_share_file",
    "cpu_workers",
    "describe_worker",
    "lending_slots",
    "pinned_cpus",
    "pool_device",
    "worker_argv",
    "worker_config",
]
