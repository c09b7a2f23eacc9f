"""Which backends exist, what each needs, and opening one by name (`make_transport`).

    tcp       any two hosts; always available
    shm       same host, POSIX shared memory + a unix control socket
    cuda_ipc  same host, GPU KV: needs CUDA; GPU-to-GPU copies through a CUDA IPC handle (gpu/cuda_ipc.py)
    nccl      GPU KV, any hosts: needs CUDA and NCCL; NCCL send/recv per connection (gpu/nccl.py)
    nixl      NVIDIA NIXL READs (UCX, LIBFABRIC, ...: `options.nixl_backends`), CPU or GPU KV, any hosts:
              needs NIXL's Python package (`nixl` or `nixl_cu12`); control over tcp's channel (nixl/mover.py)

A backend that cannot run raises `BackendUnavailable` naming what is missing (a start-up error); another
backend is used only when the caller lists it in `make_transport(..., fallback=[...])`, and then a
WARNING is logged and `describe().counts["fallbacks"]` says so.
"""

from __future__ import annotations

import importlib
import logging
import os
import socket
from collections.abc import Callable, Sequence

import torch

from splitserve.transport.channel import KVChannel
from splitserve.transport.errors import BackendUnavailable
from splitserve.transport.layout import KVLayout
from splitserve.transport.lease import FreeCallback
from splitserve.transport.transport import KVTransport, TransportOptions

log = logging.getLogger(__name__)


def _tcp() -> type[KVChannel]:
    from splitserve.transport.stream.tcp import TcpTransport

    return TcpTransport


def _shm() -> type[KVChannel]:
    try:
        importlib.import_module("_posixshmem")
    except ImportError as exc:
        raise BackendUnavailable(f"shm: POSIX shared memory is not available here ({exc})") from exc
    if not hasattr(socket, "AF_UNIX"):
        raise BackendUnavailable("shm: unix sockets are not available here")
    from splitserve.transport.stream.shm import ShmTransport

    return ShmTransport


def _cuda() -> str:
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device (torch.cuda.is_available() is False)"
    return ""


def _cuda_ipc() -> type[KVChannel]:
    missing = _cuda()
    if not missing and not hasattr(socket, "AF_UNIX"):
        missing = "unix sockets are not available here"
    if not missing and not hasattr(torch.UntypedStorage, "_new_shared_cuda"):
        missing = f"torch {torch.__version__} cannot share CUDA storage (no UntypedStorage._new_shared_cuda)"
    if missing:
        raise BackendUnavailable(f"cuda_ipc: needs CUDA on both workers of one host; {missing}")
    from splitserve.transport.gpu.cuda_ipc import CudaIpcTransport

    return CudaIpcTransport


def _nccl() -> type[KVChannel]:
    missing = _cuda()
    if not missing and not (torch.distributed.is_available() and torch.distributed.is_nccl_available()):
        missing = f"torch {torch.__version__} was built without NCCL"
    if missing:
        raise BackendUnavailable(f"nccl: needs CUDA and NCCL; {missing}")
    from splitserve.transport.gpu.nccl import NcclTransport

    return NcclTransport


def _nixl() -> type[KVChannel]:
    from splitserve.transport.nixl.env import load_nixl

    load_nixl()  # BackendUnavailable naming the install line when neither distribution imports
    from splitserve.transport.nixl.mover import NixlTransport

    return NixlTransport


BACKENDS: dict[str, Callable[[], type[KVChannel]]] = {
    "tcp": _tcp,
    "shm": _shm,
    "cuda_ipc": _cuda_ipc,
    "nccl": _nccl,
    "nixl": _nixl,
}


def open_backend(
    name: str,
    kv: torch.Tensor,
    layout: KVLayout,
    *,
    secret: bytes | str | None = None,
    on_free: FreeCallback | None = None,
    options: TransportOptions | None = None,
) -> KVTransport:
    if name not in BACKENDS:
        raise ValueError(f"unknown kv transport {name!r}; known: {', '.join(BACKENDS)}")
    cls = BACKENDS[name]()
    return cls(kv, layout, secret=secret, on_free=on_free, options=options)


def make_transport(
    backend: str,
    kv: torch.Tensor,
    layout: KVLayout,
    *,
    secret: bytes | str | None = None,
    on_free: Callable[[list[int]], None] | None = None,
    options: TransportOptions | None = None,
    fallback: Sequence[str] = (),
) -> KVTransport:
    """Open `backend`, or the first of `fallback` that can run here (logged and counted)."""
    reasons: list[str] = []
    for name in [backend, *fallback]:
        try:
            transport = open_backend(name, kv, layout, secret=secret, on_free=on_free, options=options)
        except BackendUnavailable as exc:
            reasons.append(str(exc))
            continue
        if reasons:
            log.warning(
                "kv transport %r is not available (%s); falling back to %r as explicitly allowed",
                backend,
                "; ".join(reasons),
                name,
            )
            transport.stats.fell_back(backend, reasons)
        return transport
    hint = "" if fallback else "; pass fallback=[...] to allow another backend explicitly"
    raise BackendUnavailable(f"no usable kv transport: {'; '.join(reasons)}{hint}")


def preflight(name: str, options: TransportOptions) -> None:
    """Raise `BackendUnavailable` now, before a worker loads its model, where `name` cannot run here:
    its package or CUDA is missing, or (nixl) no NIXL backend it lists has a plugin that loads; then
    NIXL is asked anyway, so that the error is NIXL's own. Cheap when the backend can run."""
    if name not in BACKENDS:
        return  # open_backend names the known ones
    BACKENDS[name]()
    if name == "nixl":
        from splitserve.transport.nixl.agent import NixlAgent
        from splitserve.transport.nixl.env import load_nixl, plugin_load_error

        module, _ = load_nixl()
        if all(plugin_load_error(module, b) for b in options.nixl_backends):
            NixlAgent(f"splitserve-preflight-{os.getpid()}", options.nixl_backends).close()


def available_backends() -> dict[str, str]:
    """name -> "ok" or why it cannot run here (for `splitserve verify`)."""
    out = {}
    for name, find in BACKENDS.items():
        try:
            find()
            out[name] = "ok"
        except BackendUnavailable as exc:
            out[name] = str(exc)
    return out
