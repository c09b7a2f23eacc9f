"""The host's RDMA fabric read from sysfs (transport/fabric.py). EFA and InfiniBand devices cannot exist on
this machine, so each case builds a fake sysfs/procfs tree in a temporary folder, shaped as the kernel lays
it out, and the last test reads the real one."""

from __future__ import annotations

import os

from splitserve.transport.fabric import probe_fabric


def _device(sys_root, name: str, driver: str) -> None:
    dev = sys_root / "class" / "infiniband" / name / "device"
    dev.mkdir(parents=True)
    drivers = sys_root / "bus" / "pci" / "drivers" / driver
    drivers.mkdir(parents=True, exist_ok=True)
    os.symlink(drivers, dev / "driver")


def _nvidia(proc_root, open_module: bool) -> None:
    (proc_root / "driver" / "nvidia").mkdir(parents=True)
    kind = "Open Kernel Module" if open_module else "Kernel Module"
    version = proc_root / "driver" / "nvidia" / "version"
    version.write_text(f"NVRM version: NVIDIA UNIX x86_64 {kind}  550\n")


def test_no_rdma_devices_is_said_in_one_line(tmp_path):
    fabric = probe_fabric(str(tmp_path / "sys"), str(tmp_path / "proc"), kernel="6.8.0")
    assert fabric.devices == () and not fabric.gpudirect
    said = fabric.path("shm", kv_on_gpu=False)
    assert said == "no EFA or InfiniBand devices on this host: KV moves over shm"


def test_efa_without_gpudirect_stages_through_host_memory(tmp_path):
    """An L4 G-series node: EFA, a proprietary driver, no peer-memory module."""
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    _device(sys_root, "efa0", "efa")
    _nvidia(proc_root, open_module=False)
    fabric = probe_fabric(str(sys_root), str(proc_root), kernel="6.1.0-aws")
    assert [(d.name, d.kind, d.driver) for d in fabric.devices] == [("efa0", "efa", "efa")]
    assert not fabric.gpudirect
    said = fabric.path("nixl/LIBFABRIC", kv_on_gpu=True)
    assert said.endswith("no GPUDirect RDMA: KV is staged through host memory")
    assert fabric.info("nixl/LIBFABRIC", True).kinds == ["efa"]


def test_peer_memory_module_or_dmabuf_gives_gpudirect(tmp_path):
    sys_root, proc_root = tmp_path / "sys", tmp_path / "proc"
    _device(sys_root, "mlx5_0", "mlx5_core")
    (sys_root / "module" / "nvidia_peermem").mkdir(parents=True)
    fabric = probe_fabric(str(sys_root), str(proc_root), kernel="5.4.0")
    assert fabric.devices[0].kind == "infiniband"
    assert fabric.gpudirect and fabric.gpudirect_via == "nvidia_peermem"

    sys2, proc2 = tmp_path / "sys2", tmp_path / "proc2"
    _device(sys2, "efa0", "efa")
    _nvidia(proc2, open_module=True)
    assert probe_fabric(str(sys2), str(proc2), kernel="6.1.0").gpudirect_via == "dma-buf"
    assert not probe_fabric(str(sys2), str(proc2), kernel="5.10.0").gpudirect  # before dma-buf import


def test_the_real_host_reads_without_error():
    fabric = probe_fabric()
    assert fabric.path("tcp", kv_on_gpu=False)
