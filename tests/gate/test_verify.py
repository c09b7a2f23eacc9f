"""`splitserve verify` fails closed: a deployment that does not run the backend it asked for, or moves KV
slower than the manifest's floor, fails with a clear reason and a non-zero exit; a correct one passes.
Real deployments of the default model (router + worker processes)."""

from __future__ import annotations

import asyncio
import ctypes.util
import importlib.util
import json
import os
import subprocess
import sys
import time

import httpx
import pytest
import torch
import yaml

from splitserve.config import load_manifest
from splitserve.gate.verify import verify_url
from splitserve.runtime.process import start_serve

pytestmark = pytest.mark.slow
os.environ.setdefault(
    "SPLITSERVE_KV_SECRET", "splitserve-test-secret-0123456789abcdef"
)  # deployments inherit it

BASE = {
    "model": {"max_model_len": 1024},
    "engine": {"kv_cache_mb": 96, "max_num_seqs": 8},
    "server": {"port": 0},
    # no standby spare worker: nothing here restarts one, and starting it takes CPU from the gate's probes
    "runtime": {"standby": False},
}


def _manifest(tmp_path, **sections) -> str:
    data = {**BASE, **sections}
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _verify_cli(*args: str) -> tuple[int, str, dict]:
    out = subprocess.run(
        [sys.executable, "-m", "splitserve.cli", "verify", *args], capture_output=True, text=True, timeout=600
    )
    report = {}
    if "--json" in args:
        report = json.loads(open(args[args.index("--json") + 1]).read())
    return out.returncode, out.stdout + out.stderr, report


def test_a_correct_deployment_passes(tmp_path):
    path = _manifest(tmp_path, transport={"backend": "shm"})
    code, out, report = _verify_cli(path, "--json", str(tmp_path / "r.json"))
    assert code == 0, out
    assert report["ok"] and out.strip().endswith("PASS")
    names = {c["name"] for c in report["checks"]}
    assert {"kv backend", "handshake", "latency", "bandwidth", "round trip", "transfer share"} <= names
    backend = [c for c in report["checks"] if c["name"] == "kv backend"]
    assert {c["value"] for c in backend} == {"shm"}
    fabric = [c for c in report["checks"] if c["name"] == "fabric"]
    assert len(fabric) == 2 and all(c["ok"] for c in fabric)  # the prefill and the decode worker
    if not os.path.isdir("/sys/class/infiniband"):
        said = {c["detail"] for c in fabric}
        assert said == {"no EFA or InfiniBand devices on this host: KV moves over shm"}


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl can run here")
def test_a_fallback_that_happened_fails(tmp_path):
    """Asked for nccl (no CUDA here), allowed to fall back to tcp: it serves, and the gate fails."""
    path = _manifest(tmp_path, transport={"backend": "nccl", "fallback": ["tcp"]})
    code, out, report = _verify_cli(path, "--json", str(tmp_path / "r.json"))
    assert code == 1, out
    bad = [c for c in report["checks"] if not c["ok"]]
    assert {c["name"] for c in bad} == {"kv backend"}, bad
    assert all(
        "runs tcp (asked nccl); required nccl" in c["detail"] and "FELL BACK" in c["detail"] for c in bad
    )
    assert "nccl" in bad[0]["detail"] and "CUDA" in bad[0]["detail"]


@pytest.mark.skipif(torch.cuda.is_available(), reason="nccl can run here")
def test_an_unavailable_backend_without_fallback_never_serves(tmp_path):
    path = _manifest(tmp_path, transport={"backend": "nccl"})
    code, out, report = _verify_cli(path, "--json", str(tmp_path / "r.json"))
    assert code == 1 and not report["ok"]
    assert "did not start" in report["error"] and "nccl" in report["error"], report["error"]


def test_required_backend_differs_from_the_one_running(tmp_path):
    """A tcp deployment gated on shm (say, a manifest meant for one host run across two) fails."""
    path = _manifest(tmp_path, transport={"backend": "tcp", "required_backends": ["shm"]})
    code, out, _ = _verify_cli(path)
    assert code == 1 and "runs tcp (asked tcp); required shm" in out, out


def test_a_throttled_transport_fails_the_gate_and_fires_the_alert_metric(tmp_path):
    manifest = load_manifest(
        _manifest(
            tmp_path,
            transport={"backend": "shm"},
            verify={"min_gbps": 0.5, "probe_mb": 8, "probe_interval_s": 0.5, "runtime_probe_mb": 2},
            runtime={"worker_args": ["--kv-throttle-gbps", "0.05"], "standby": False},
        )
    )
    with start_serve(manifest) as sp:
        folder = sp.tmpdir
        assert folder is not None and (folder / "manifest.yaml").exists()
        report = asyncio.run(verify_url(sp.url))
        assert not report.ok
        bandwidth = [c for c in report.checks if c.name == "bandwidth"]
        assert len(bandwidth) == 1 and not bandwidth[0].ok and bandwidth[0].value < 0.5, report.table()
        assert "floor 0.5 GB/s" in bandwidth[0].detail
        assert {c.name for c in report.checks if not c.ok} == {"bandwidth"}, report.table()
        deadline = time.monotonic() + 30
        while True:  # the run-time probe sees it too, and raises the alert's metric
            text = httpx.get(f"{sp.url}/metrics", timeout=10).text
            low = [line for line in text.splitlines() if line.startswith("splitserve:kv_bandwidth_low{")]
            if low and all(line.endswith(" 1.0") for line in low):
                break
            assert time.monotonic() < deadline, text
            time.sleep(0.5)
        assert "splitserve:kv_min_gbps" in text and "splitserve:kv_probe_gbps{" in text
    assert not folder.exists()  # the deployment's temp folder goes with it


# -- nixl: the reference deployment's trap ---------------------------------------------------------
NIXL_HERE = any(importlib.util.find_spec(n) for n in ("nixl", "nixl_cu12", "nixl_cu13"))
needs_nixl_without_libfabric = pytest.mark.skipif(
    not NIXL_HERE or ctypes.util.find_library("fabric") is not None,
    reason="needs NIXL (pip install --no-deps nixl-cu12==1.5.1) on a host without libfabric",
)


@needs_nixl_without_libfabric
def test_nixl_asking_libfabric_alone_never_starts_and_says_why(tmp_path):
    path = _manifest(tmp_path, transport={"backend": "nixl", "nixl_backends": ["LIBFABRIC"]})
    code, out, report = _verify_cli(path, "--json", str(tmp_path / "r.json"))
    assert code == 1 and not report["ok"]
    error = report["error"]
    assert "did not start" in error and "LIBFABRIC" in error and "NIXL_ERR_NOT_FOUND" in error, error


@needs_nixl_without_libfabric
def test_nixl_libfabric_falling_back_to_ucx_serves_and_fails_the_gate(tmp_path):
    """[LIBFABRIC, UCX]: it serves over UCX (the round trip equals colocated), says so in /stats, the
    TTFT headers and /metrics, and fails `verify` until the manifest accepts nixl/UCX."""
    transport = {"backend": "nixl", "nixl_backends": ["LIBFABRIC", "UCX"], "checksum": "crc32"}
    manifest = load_manifest(_manifest(tmp_path, transport=transport))
    with start_serve(manifest) as sp:
        report = asyncio.run(verify_url(sp.url))
        bad = [c for c in report.checks if not c.ok]
        assert {c.name for c in bad} == {"kv backend"}, report.table()
        assert all("runs nixl/UCX (asked nixl/LIBFABRIC)" in c.detail for c in bad), report.table()
        assert all("NIXL_ERR_NOT_FOUND" in c.detail for c in bad), report.table()
        # the SmolLM2-over-nixl case of #22 (item 1): greedy, separate processes, token for token
        trip = [c for c in report.checks if c.name == "round trip"]
        assert trip and all(c.ok for c in trip), report.table()
        share = [c for c in report.checks if c.name == "transfer share"]
        assert all("over nixl/UCX" in c.detail for c in share), report.table()
        r = httpx.post(
            f"{sp.url}/v1/completions",
            json={"model": manifest.model.resolved_served_name(), "prompt": "Hello there", "max_tokens": 4},
            timeout=60,
        )
        assert r.status_code == 200 and r.headers.get("x-splitserve-kv-backend") == "nixl/UCX", r.headers
        text = httpx.get(f"{sp.url}/metrics", timeout=10).text
        fallbacks = [
            line for line in text.splitlines() if line.startswith("splitserve:kv_transport_fallbacks{")
        ]
        assert fallbacks and all(line.endswith(" 1.0") for line in fallbacks), fallbacks
        assert 'backend="nixl/UCX"' in text and 'requested="nixl/LIBFABRIC"' in text
    accepted = load_manifest(_manifest(tmp_path, transport={**transport, "required_backends": ["nixl/UCX"]}))
    assert accepted.transport.required() == ["nixl/UCX"] and manifest.transport.required() == [
        "nixl/LIBFABRIC"
    ]
