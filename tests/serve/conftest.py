"""The serving tests' session deployments (one disaggregated, one colocated) and OpenAI's schema; the
helpers they are built from are in serve_harness.py."""

from __future__ import annotations

import json

import pytest
from serve_harness import API_KEY, SCHEMA_PATHS, Deployment, manifest_yaml, start_deployment


@pytest.fixture(scope="session")
def disaggregated() -> Deployment:
    """Disaggregated (1 prefill + 1 decode over shm), API keys on."""
    dep = start_deployment(manifest_yaml(mode="disaggregated"), API_KEY)
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)


@pytest.fixture(scope="session")
def colocated() -> Deployment:
    """Colocated (1 worker), no keys, a small bounded queue (2 running + 1 queued) for the overload test."""
    manifest = manifest_yaml(
        mode="colocated", server={"port": 0, "max_concurrent_requests": 2, "max_queued_requests": 1}
    )
    dep = start_deployment(manifest)
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)


@pytest.fixture(scope="session")
def openai_schema() -> dict:
    path = next(p for p in SCHEMA_PATHS if p.exists())
    return json.loads(path.read_text())
