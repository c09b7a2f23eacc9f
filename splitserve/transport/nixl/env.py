"""Loading NIXL and the environment it needs, before an agent is made (agent.py): its Python API
under either distribution name, UCX's modules, UCX's error-handling mode and cuda_ipc GETs for a KV
pool's device, the CUDA 12 runtime nixl-cu12's UCX links, why a backend's plugin cannot load, and what
NIXL's C++ code writes to stderr.
"""

from __future__ import annotations

import contextlib
import ctypes
import glob
import importlib
import importlib.util
import logging
import os
import sys
import tempfile
from collections.abc import Iterator
from types import ModuleType

import torch

from splitserve.transport.errors import BackendUnavailable
from splitserve.transport.fabric import Fabric, host_fabric

log = logging.getLogger(__name__)

DISTRIBUTIONS = ("nixl", "nixl_cu12", "nixl_cu13")  # module names NIXL's wheels install
NIXL_BACKENDS = ("UCX", "LIBFABRIC")  # what a manifest may name (others: not tried here)


def load_nixl() -> tuple[ModuleType, str]:
    """NIXL's Python API (`nixl_agent`, ...) and the module it came from; BackendUnavailable if none."""
    skip_efa_without_device()  # before UCX is loaded: it reads its settings once
    errors = []
    for name in DISTRIBUTIONS:
        try:
            mod = importlib.import_module(name)
            if not hasattr(mod, "nixl_agent"):
                mod = importlib.import_module(f"{name}._api")
            quiet = logging.getLogger("nixl")  # NIXL logs INFO to stdout; ours go to logging's handlers
            quiet.handlers.clear()
            quiet.propagate = True
            return mod, name
        except ImportError as exc:
            errors.append(f"{name}: {exc}")
    raise BackendUnavailable(
        "nixl: the NIXL Python package is not installed "
        "(pip install --no-deps nixl-cu12==1.5.1, then numpy); " + "; ".join(errors)
    )


UCX_MODULES_ENV = "UCX_MODULES"  # UCX's own: glob patterns of the modules it loads, "^" excludes


def skip_efa_without_device(fabric: Fabric | None = None) -> str | None:
    """On a host without an EFA device, UCX does not load its EFA module (`UCX_MODULES=^efa`), unless
    the operator set UCX_MODULES; -> the value in force, or None (all of UCX's modules load).

    NOTE: nixl-cu12 bundles its own libibverbs and libnl, but UCX's EFA module links the host's libefa,
    which loads the host's libibverbs and libnl beside them. Two copies of libnl-route in one process
    crash in their exit-time destructors (SIGSEGV in rtnl_tc_unregister, after the interpreter has
    finished: a process that used NIXL then ends with status 139 after a clean shutdown). Without an
    EFA device the module has nothing to drive."""
    fabric = host_fabric() if fabric is None else fabric
    if UCX_MODULES_ENV in os.environ or "efa" in fabric.kinds():
        return os.environ.get(UCX_MODULES_ENV)
    os.environ[UCX_MODULES_ENV] = "^efa"
    return os.environ[UCX_MODULES_ENV]


UCX_ERROR_ENV = "SPLITSERVE_NIXL_UCX_ERROR_HANDLING"  # none | peer: overrides ucx_error_mode()


def ucx_error_mode(device: torch.device) -> str:
    """NIXL's UCX `ucx_error_handling_mode` for a KV pool on `device`: `none` for GPU memory, `peer` (NIXL's
    default) for host memory; $SPLITSERVE_NIXL_UCX_ERROR_HANDLING overrides.

    NOTE: with `peer`, UCX keeps only transports that can report a peer's failure (its shared-memory ones
    cannot: "sysv/memory - no peer failure handler"); on the H200 a VRAM READ between two processes of
    one GPU then ran emulated over tcp/lo at 0.5 GB/s, with `none` emulated over sysv/memory at 0.8 GB/s
    (docs/bench/kv-nixl.md). A dead exporter is still caught by the transport itself (the control
    connection is polled during a READ, and every READ has a deadline)."""
    mode = os.environ.get(UCX_ERROR_ENV, "").strip().lower()
    if mode in ("none", "peer"):
        return mode
    return "none" if device.type == "cuda" else "peer"


CUDA_IPC_GET_ENV = "UCX_CUDA_IPC_ENABLE_GET_ZCOPY"  # UCX's own: on | off | auto (its default)


def enable_cuda_ipc_get(device: torch.device) -> str | None:
    """For a KV pool on a GPU: UCX's cuda_ipc GET zero-copy `on`, unless the operator set it; -> the value.
    Set in this process's environment before the agent's UCX context reads it.

    NOTE: UCX's `auto` turns cuda_ipc GETs off where NVML reports no NVLink ("cuda-ipc get zcopy disabled
    as no nvlinks detected", UCX_LOG_LEVEL=debug on the one-GPU H200 machine), and a NIXL READ, a GET,
    then runs as UCX's "software emulation" over active messages at 0.5-0.9 GB/s, where a device copy
    does 1,900 GB/s. Two processes on one GPU (no NVLink to report) are exactly that case. Across GPUs
    joined only by PCIe UCX judges GETs slower than PUTs; still far faster than the emulation."""
    if device.type != "cuda":
        return None
    return os.environ.setdefault(CUDA_IPC_GET_ENV, "on")


CUDART = "libcudart.so.12"  # what nixl-cu12's UCX (libucm_cuda) links; a CUDA 13 image has .so.13 only


def preload_cuda_runtime() -> str | None:
    """Load the CUDA 12 runtime, so that UCX's CUDA module, loaded later, finds it by soname (the loader
    matches loaded objects by soname first; RTLD_LOCAL keeps torch's CUDA 13 symbols ours); -> where from.

    NOTE: without libcudart.so.12, UCX's libucm_cuda does not load, UCX then reports GPU memory as host
    memory and NIXL refuses VRAM ("VRAM memory is detected as host by UCX"; seen on the H200 image,
    CUDA 13). `pip install --no-deps nixl-cu12` leaves out the `nvidia-cuda-runtime-cu12` wheel that
    carries it; with that wheel installed, its copy is loaded from there."""
    if not torch.cuda.is_available():
        return None
    candidates = [CUDART]
    spec = importlib.util.find_spec("nvidia.cuda_runtime") if importlib.util.find_spec("nvidia") else None
    for folder in (spec.submodule_search_locations or []) if spec else []:
        candidates.append(os.path.join(folder, "lib", CUDART))
    for path in candidates:
        try:
            ctypes.CDLL(path, mode=os.RTLD_NOW | os.RTLD_LOCAL)
            return path
        except OSError:
            continue
    log.warning("nixl: %s is not loadable here: UCX cannot register GPU memory without it "
                "(pip install --no-deps nvidia-cuda-runtime-cu12)", CUDART)  # fmt: skip
    return None


@contextlib.contextmanager
def stderr_captured(into: list[str]) -> Iterator[None]:
    """What C++ code writes to fd 2 meanwhile (NIXL logs its reasons there), appended to `into` and
    echoed to the real stderr afterwards."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as tmp:
        saved = os.dup(2)
        os.dup2(tmp.fileno(), 2)
        try:
            yield
        finally:
            os.dup2(saved, 2)
            os.close(saved)
            tmp.seek(0)
            text = tmp.read().decode(errors="replace")
            if text:
                sys.stderr.write(text)
                into.append(text.strip())


def plugin_load_error(module: ModuleType, backend: str) -> str | None:
    """Why NIXL's plugin for `backend` cannot be loaded (a missing library), or None if it can."""
    site = os.path.dirname(os.path.dirname(module.__file__ or ""))  # .../site-packages
    name = f"libplugin_{backend}.so"
    dirs = [os.path.join(site, d, "plugins") for d in (".*", "*")]
    dirs += [os.environ["NIXL_PLUGIN_DIR"]] if os.environ.get("NIXL_PLUGIN_DIR") else []
    paths = [p for d in dirs for p in glob.glob(os.path.join(d, name))]
    if not paths:
        return f"no libplugin_{backend}.so in this NIXL build"
    try:
        ctypes.CDLL(paths[0], mode=os.RTLD_LAZY | os.RTLD_LOCAL)
    except OSError as exc:
        return str(exc)
    return None


__all__ = [
    "CUDART",
    "enable_cuda_ipc_get",
    "load_nixl",
    "plugin_load_error",
    "preload_cuda_runtime",
    "skip_efa_without_device",
    "stderr_captured",
    "ucx_error_mode",
]
