"""Fixtures for the KV transport tests: transports with in-process exporter threads, no secret in the
environment, and a /dev/shm leak check around the whole session."""

from __future__ import annotations

import pytest
from kv_helpers import SECRET, layout_of, our_segments, shared_copy, small_kv

from splitserve.transport import TransportOptions, make_transport


@pytest.fixture(scope="session", autouse=True)
def no_shm_leaks():
    before = our_segments()
    yield
    leaked = our_segments() - before
    assert not leaked, f"shared-memory segments left in /dev/shm: {sorted(leaked)}"


@pytest.fixture(autouse=True)
def _no_env_secret(monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KV_SECRET", raising=False)


@pytest.fixture
def make():
    """make(backend, kv_cache=, layout=, secret=, on_free=, **options) -> transport, closed after the test.

    "shm-direct" is shm with the KV copied into shared memory (allocate_shared_kv) first."""
    made = []

    def _make(backend, kv_cache=None, layout=None, secret=SECRET, on_free=None, **options):
        kv_cache = small_kv() if kv_cache is None else kv_cache
        if backend == "shm-direct":
            backend, kv_cache = "shm", shared_copy(kv_cache)
        t = make_transport(
            backend, kv_cache, layout or layout_of(kv_cache), secret=secret,
            on_free=on_free, options=TransportOptions(**options),
        )  # fmt: skip
        made.append(t)
        return t

    yield _make
    for t in made:
        t.close()
