"""What a worker of a pool gets from the manifest: its command line (local runtime) or its config
(the Ray runtime builds the worker in its replica process)."""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING

from splitserve.config.manifest import Manifest

if TYPE_CHECKING:
    from splitserve.serve.worker_config import WorkerConfig


def pool_device(manifest: Manifest, role: str, index: int) -> str:
    pool = manifest.pools()[role]
    return pool.devices[index % len(pool.devices)] if pool.devices else manifest.model.device


def worker_argv(manifest: Manifest, role: str, index: int, secret_env: str) -> list[str]:
    """The command line of one worker: its `worker_config` as JSON (`--spec`, no secret), then
    `runtime.worker_args` (flags given beside the spec override its fields). Every role gets the
    deployment's secret in the environment variable `secret_env`: it keys the KV handshake and the
    worker API's token."""
    spec = worker_config(manifest, role, index, "-", "127.0.0.1").to_json(include_secret=False)
    argv = [sys.executable, "-m", "splitserve.serve.worker", "--spec", spec, "--kv-secret-env", secret_env,
            "--host", "127.0.0.1", "--port", "0"]  # fmt: skip
    return argv + list(manifest.runtime.worker_args)


def worker_config(manifest: Manifest, role: str, index: int, secret: str | None, host: str) -> WorkerConfig:
    """One worker's config from the manifest (its engine from `engine_for(role)`): what the local
    runtime hands a worker process as `--spec` and the Ray runtime builds its replica's worker from.
    `secret`: the deployment's (None: no worker API auth)."""
    from splitserve.engine.config import EngineConfig
    from splitserve.serve.worker_config import WorkerConfig

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
    )


def cpu_threads(manifest: Manifest) -> int:
    """A CPU worker's intra-op threads when the manifest leaves them out: this host's cores shared
    evenly among the deployment's workers that are not on a GPU (colocated on 2 cores: 2; a prefill
    and a decode worker: 1 each)."""
    workers = sum(
        1
        for role, pool in manifest.pools().items()
        for i in range(pool.replicas)
        if not pool_device(manifest, role, i).startswith("cuda")
    )
    return max(1, (os.cpu_count() or 1) // max(1, workers))


__all__ = ["pool_device", "worker_argv", "worker_config"]
