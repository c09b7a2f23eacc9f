"""A worker's command line: `--spec` (a runtime's WorkerConfig as JSON) and flags over it.

The engine's flags are made from `EngineConfig`'s fields (one flag per field, its default and type read
from the dataclass), so an engine knob is declared once, in config/engine.py. Every flag that sets a
config field is left out of the namespace unless given, so that what is given overrides the spec (or
the declared defaults when there is no spec) and nothing else does.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
import typing

from splitserve.config.engine import EngineConfig
from splitserve.config.worker import ROLES, WorkerConfig

_DEFAULTS, _ENGINE_DEFAULTS = WorkerConfig(), EngineConfig()
# EngineConfig fields a worker sets itself (or through --kv-cache-mb), not flags
_ENGINE_INTERNAL = {"progress", "kv_shared_memory", "kv_cache_bytes"}
_ENGINE_HELP = {
    "model": "HF directory, GGUF file or random:SHAPE; None: the embedded SmolLM2-135M",
    "tokenizer": "HF directory or GGUF file; None: the model's",
    "gpu_memory_utilization": "CUDA: the share of the device this worker may hold",
    "enforce_eager": "CUDA: no decode CUDA graphs",
    "async_scheduling": "overlap the host's and the GPU's work in decode (auto: on for CUDA)",
    "weight_cache_dir": '"auto", a path, or "off"',
    "weight_cache_verify": "a CRC32 of every chunk on load",
    "cpu_weights": "CPU: fp32 (token-exact) or int4 (weight-only int4, bf16 activations)",
    "tensor_parallel_one_device": "test mode: every tensor-parallel rank on one GPU, collectives over gloo",
}
_TRI = {"auto": None, "on": True, "off": False}
# dests that are not a WorkerConfig field of the same name: dest -> field
_WORKER_FLAGS = {"host": "kv_host", "enable_fault_injection": "fault_injection"}
_NOT_FIELDS = {"spec", "port", "kv_secret_env", "verbose"}


def _csv(text: str) -> tuple[str, ...]:
    return tuple(b for b in text.split(",") if b)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m splitserve.worker.main",
                                description="a splitserve worker (front end + engine core)")  # fmt: skip
    keep = argparse.SUPPRESS
    p.add_argument("--spec", default=None,
                   help="the worker's config as JSON (a runtime's WorkerConfig, no secret); flags given "
                        "beside it override its fields")  # fmt: skip
    p.add_argument("--port", type=int, default=0, help="HTTP port; 0: the OS picks (printed)")
    p.add_argument("--kv-secret-env", default="SPLITSERVE_KV_SECRET",
                   help="name of the environment variable holding the shared KV secret")  # fmt: skip
    p.add_argument("-v", "--verbose", action="store_true")
    w = p.add_argument_group("worker")
    w.add_argument("--role", choices=ROLES, default=keep)
    w.add_argument("--host", default=keep, help=f"HTTP (and tcp KV) address to bind ({_DEFAULTS.kv_host})")
    w.add_argument("--kv-backend", default=keep,
                   help="tcp | shm | cuda_ipc (GPU KV, one host) | nccl (GPU KV) | nixl")  # fmt: skip
    w.add_argument("--kv-nixl-backends", default=keep, type=_csv,
                   help="nixl: NIXL backends, comma-separated; the first that starts wins")  # fmt: skip
    w.add_argument("--kv-fallback", default=keep, type=_csv,
                   help="comma-separated backends allowed if --kv-backend cannot run (logged)")  # fmt: skip
    w.add_argument("--kv-lease-s", type=float, default=keep, help="free an unclaimed export after this")
    w.add_argument("--kv-fetch-timeout-s", type=float, default=keep, help="default deadline of an import")
    w.add_argument("--kv-policy", choices=("fail", "recompute"), default=keep)
    w.add_argument("--kv-checksum", choices=("crc32", "blake2b"), default=keep)
    w.add_argument("--threads", type=int, default=keep, help="the engine core's torch intra-op threads")
    w.add_argument("--stream-interval", type=int, default=keep,
                   help="tokens per stream line at least (fewer only at the end)")  # fmt: skip
    w.add_argument("--enable-fault-injection", action="store_true", default=keep,
                   help="tests: POST /debug/faults")  # fmt: skip
    w.add_argument(
        "--http-auth",
        action="store_true",
        default=keep,
        help="require a bearer token derived from the KV secret on every endpoint but /health",
    )
    w.add_argument("--kv-throttle-gbps", type=float, default=keep, help="test hook: fetches at this GB/s")
    w.add_argument("--kv-fetch-fraction", type=float, default=keep, help="test hook: fetches land this share")
    _engine_flags(p.add_argument_group("engine (EngineConfig's fields)"))
    return p


def _engine_flags(g: argparse._ArgumentGroup) -> None:
    hints = typing.get_type_hints(EngineConfig)
    keep = argparse.SUPPRESS
    for f in dataclasses.fields(EngineConfig):
        if f.name in _ENGINE_INTERNAL:
            continue
        flag, default = "--" + f.name.replace("_", "-"), getattr(_ENGINE_DEFAULTS, f.name)
        base = _base_type(hints[f.name])
        help_ = f"{_ENGINE_HELP.get(f.name, '')} (default: {default})".lstrip()
        if base is bool and default is None:
            g.add_argument(flag, choices=tuple(_TRI), type=str, default=keep, help=help_)
        elif base is bool:
            g.add_argument(flag, action=argparse.BooleanOptionalAction, default=keep, help=help_)
        elif f.name == "weight_cache_dir":
            g.add_argument(flag, type=lambda s: None if s == "off" else s, default=keep, help=help_)
        else:
            g.add_argument(flag, type=base, default=keep, help=help_)
    g.add_argument(
        "--kv-cache-mb",
        type=int,
        default=keep,
        help="KV cache budget in MiB; wins over --gpu-memory-utilization (default: the engine's)",
    )


def _base_type(hint: object) -> type:
    """int for `int | None`, and so on."""
    if not isinstance(hint, types.UnionType):
        return hint  # type: ignore[return-value]
    return next(a for a in typing.get_args(hint) if a is not type(None))


def config_from_args(args: argparse.Namespace) -> WorkerConfig:
    """The worker's config: `--spec` (or the declared defaults) with the flags given over it."""
    secret = os.environ.get(args.kv_secret_env) or None
    base = WorkerConfig(kv_secret=secret)
    if args.spec:
        base = WorkerConfig.from_json(args.spec, kv_secret=secret)
    given = {d: v for d, v in vars(args).items() if d not in _NOT_FIELDS}
    engine_names = {f.name for f in dataclasses.fields(EngineConfig)}
    engine = {d: v for d, v in given.items() if d in engine_names}
    if "async_scheduling" in engine:
        engine["async_scheduling"] = _TRI[engine["async_scheduling"]]
    if "kv_cache_mb" in given:
        mb = given.pop("kv_cache_mb")
        engine["kv_cache_bytes"] = None if mb is None else mb << 20
    worker = {_WORKER_FLAGS.get(d, d): v for d, v in given.items() if d not in engine_names}
    role, http_auth = worker.get("role", base.role), worker.get("http_auth", base.http_auth)
    if (role != "colocated" or http_auth) and not secret:
        why = "--http-auth" if role == "colocated" else f"the {role} role"
        raise ValueError(f"{why} needs the deployment's shared secret in ${args.kv_secret_env}")
    return dataclasses.replace(base, engine=dataclasses.replace(base.engine, **engine), **worker)


__all__ = ["build_parser", "config_from_args"]
