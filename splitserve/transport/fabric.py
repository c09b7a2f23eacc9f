"""The host's RDMA fabric as the kernel shows it: EFA or InfiniBand devices, and whether a GPU's memory
can be handed to them directly (GPUDirect RDMA), or KV must be staged through host memory.

Read from sysfs only (no driver calls), so a worker reports it at start-up on any host:

  devices     /sys/class/infiniband/<name>: its driver (`efa` for AWS EFA, `mlx5_core` etc. for
              InfiniBand / RoCE) names the kind
  GPUDirect   the NVIDIA peer-memory module loaded (/sys/module/nvidia_peermem, or the older
              nv_peer_mem), or dma-buf: the NVIDIA open kernel module (/proc/driver/nvidia/version
              says "Open Kernel Module") on Linux >= 5.12, which EFA and mlx5 use for GPU memory

What a device can do with either is decided by its firmware and instance type (AWS's G-series nodes
with EFA, such as the L4 ones, have no GPUDirect RDMA whatever the modules): so this module says what
the host offers, and `splitserve verify` measures the path actually taken and holds it to the
manifest's bandwidth floor.
"""

from __future__ import annotations

import functools
import os
import platform
from dataclasses import dataclass
from pathlib import Path

from splitserve.wire.transport_info import FabricInfo

PEERMEM_MODULES = ("nvidia_peermem", "nv_peer_mem")
DMABUF_KERNEL = (5, 12)  # Linux gained RDMA dma-buf import in 5.12


@dataclass(frozen=True)
class RdmaDevice:
    name: str  # efa0, mlx5_0
    kind: str  # "efa" | "infiniband"
    driver: str  # the kernel driver bound to it ("" if unknown)


@dataclass(frozen=True)
class Fabric:
    devices: tuple[RdmaDevice, ...]
    gpudirect: bool  # the host offers GPU memory to RDMA devices (peer-memory module or dma-buf)
    gpudirect_via: str  # "nvidia_peermem" | "nv_peer_mem" | "dma-buf" | ""

    def kinds(self) -> list[str]:
        return sorted({d.kind for d in self.devices})

    def path(self, backend: str, kv_on_gpu: bool) -> str:
        """The path KV takes between hosts with this fabric, in words."""
        if not self.devices:
            return f"no EFA or InfiniBand devices on this host: KV moves over {backend}"
        names = ", ".join(d.name for d in self.devices)
        if not kv_on_gpu:
            return f"RDMA devices {names}; the KV pool is in host memory"
        if self.gpudirect:
            return f"RDMA devices {names}; GPUDirect RDMA available ({self.gpudirect_via})"
        return f"RDMA devices {names}; no GPUDirect RDMA: KV is staged through host memory"

    def info(self, backend: str, kv_on_gpu: bool) -> FabricInfo:
        """As a transport's description carries it (wire/transport_info.py)."""
        names, path = [d.name for d in self.devices], self.path(backend, kv_on_gpu)
        return FabricInfo(names, self.kinds(), self.gpudirect, self.gpudirect_via, path)


def _driver(dev: Path) -> str:
    try:
        return os.path.basename(os.readlink(dev / "device" / "driver"))
    except OSError:
        return ""


def _kernel_at_least(release: str, want: tuple[int, int]) -> bool:
    parts = release.split("-")[0].split(".")
    try:
        return (int(parts[0]), int(parts[1])) >= want
    except (IndexError, ValueError):
        return False


def probe_fabric(sys_root: str = "/sys", proc_root: str = "/proc", kernel: str | None = None) -> Fabric:
    """The fabric of this host (roots and kernel release are arguments so tests can point at a copy)."""
    devices = []
    ib = Path(sys_root) / "class" / "infiniband"
    for dev in sorted(ib.iterdir()) if ib.is_dir() else ():
        driver = _driver(dev)
        kind = "efa" if driver == "efa" or dev.name.startswith("efa") else "infiniband"
        devices.append(RdmaDevice(dev.name, kind, driver))
    via = next((m for m in PEERMEM_MODULES if (Path(sys_root) / "module" / m).is_dir()), "")
    if not via:
        try:
            version = (Path(proc_root) / "driver" / "nvidia" / "version").read_text()
        except OSError:
            version = ""
        release = platform.release() if kernel is None else kernel
        if "Open Kernel Module" in version and _kernel_at_least(release, DMABUF_KERNEL):
            via = "dma-buf"
    return Fabric(tuple(devices), gpudirect=bool(via), gpudirect_via=via)


@functools.cache
def host_fabric() -> Fabric:
    """This host's fabric, read once per process."""
    return probe_fabric()


__all__ = ["Fabric", "RdmaDevice", "host_fabric", "probe_fabric"]
