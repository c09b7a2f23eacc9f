"""`splitserve verify` proves the split: on deployments built not to disaggregate (the handoff broken so
that decode recomputes every prompt, the router bypassing the prefill pool, a transfer that moves half
the bytes) it fails, naming the fact; on a correct one the three facts pass. Real deployments of the
default model (router + worker processes)."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import yaml

from splitserve.config import load_manifest
from splitserve.gate.verify import verify_url
from splitserve.runtime.process import start_serve
from splitserve.wire.auth import worker_headers

pytestmark = pytest.mark.slow
SECRET = os.environ.setdefault("SPLITSERVE_KV_SECRET", "splitserve-test-secret-0123456789abcdef")
FACTS = {"prefill pool", "decode recompute", "handoff bytes"}


def _manifest(tmp_path, **sections):
    data = {
        "model": {"max_model_len": 1024},
        "engine": {"kv_cache_mb": 96, "max_num_seqs": 8},
        "server": {"port": 0},
        "verify": {"probe_interval_s": 0, "probe_mb": 4},
        "runtime": {"standby": False},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_manifest(path)


def _facts(report) -> dict[str, tuple[bool, str]]:
    return {c.name: (c.ok, c.detail) for c in report.checks if c.name in FACTS}


def _workers(url: str, role: str) -> list[str]:
    dep = httpx.get(f"{url}/admin/deployment", headers=worker_headers(SECRET), timeout=10).json()
    return [w["url"] for w in dep["workers"] if w["role"] == role]


def test_a_correct_deployment_proves_its_split(tmp_path):
    with start_serve(_manifest(tmp_path)) as sp:
        report = asyncio.run(verify_url(sp.url))
    facts = _facts(report)
    assert set(facts) == FACTS, report.table()
    assert all(ok for ok, _ in facts.values()), report.table()
    assert report.ok, report.table()
    assert "recomputed no handed-off prompt" in facts["decode recompute"][1]


def test_a_broken_handoff_under_the_recompute_policy_fails_as_recomputation(tmp_path):
    """The prefill worker's exporter hangs up on every fetch; the `recompute` policy makes the decode
    worker prefill each prompt again: the answers are right, the split is not there."""
    manifest = _manifest(tmp_path, transport={"policy": "recompute"},
                         runtime={"worker_args": ["--enable-fault-injection"]})  # fmt: skip
    with start_serve(manifest) as sp:
        for url in _workers(sp.url, "prefill"):
            r = httpx.post(
                f"{url}/debug/faults", json={"kill": 1.0}, headers=worker_headers(SECRET), timeout=10
            )
            assert r.status_code == 200, r.text
        report = asyncio.run(verify_url(sp.url))
    facts = _facts(report)
    assert not report.ok
    ok, detail = facts["decode recompute"]
    assert not ok and detail.startswith("RECOMPUTED: decode workers recomputed"), report.table()
    assert facts["prefill pool"][0], report.table()  # the prefill pool did prefill (then lost the KV)
    assert not facts["handoff bytes"][0] and "no prompt KV was handed off" in facts["handoff bytes"][1]
