"""Workers pinned to cores of their own (`runtime.pin_cores`, core/pinning.py): the split of the
host's CPUs, what the runtime hands each worker, and a real deployment whose front ends and engine
cores run bound to their worker's CPUs and still answer."""

from __future__ import annotations

import json
import os

import httpx
import pytest

from splitserve.config import parse_manifest
from splitserve.core.pinning import host_cpus, pin, split_cpus
from splitserve.runtime.common import lending_slots, pinned_cpus, worker_argv
from splitserve.wire.auth import worker_headers


def test_the_host_cpus_split_into_disjoint_equal_shares() -> None:
    assert split_cpus([0, 1], 2) == [(0,), (1,)]
    assert split_cpus([0, 1, 2, 3], 2) == [(0, 1), (2, 3)]
    assert split_cpus([0, 1, 2, 3, 4], 2) == [(0, 1), (2, 3)]  # the remainder is left to the router
    assert split_cpus([4, 6], 1) == [(4, 6)]
    assert split_cpus([0, 1], 3) == [(0,), (1,), (0,)]  # more workers than CPUs: some share
    assert split_cpus([0, 1], 0) == [] and split_cpus([], 2) == []


def test_a_pinned_deployment_gives_each_worker_its_cpus_and_lends_nothing() -> None:
    pd = parse_manifest("mode: disaggregated\nruntime: {pin_cores: true}\n", "test")
    shares = split_cpus(host_cpus(), 2)
    assert pinned_cpus(pd) == {("prefill", 0): shares[0], ("decode", 0): shares[1]}
    assert lending_slots(pd) == {}
    spec = json.loads(worker_argv(pd, "decode", 0, "SECRET")[4])
    assert spec["cpus"] == list(shares[1]) and spec["threads"] == len(shares[1])
    unpinned = parse_manifest("mode: disaggregated\n", "test")
    assert pinned_cpus(unpinned) == {}
    assert json.loads(worker_argv(unpinned, "decode", 0, "SECRET")[4])["cpus"] == []


def test_pin_binds_every_thread_of_the_process_and_back() -> None:
    cpus = host_cpus()
    try:
        pin(cpus[:1])
        for tid in os.listdir("/proc/self/task"):
            assert os.sched_getaffinity(int(tid)) == {cpus[0]}
    finally:
        pin(cpus)
    assert host_cpus() == cpus


def _allowed(pid: int) -> set[int]:
    return os.sched_getaffinity(pid)


def test_a_pinned_deployments_workers_and_cores_run_on_their_own_cpus() -> None:
    if len(host_cpus()) < 2:
        pytest.skip("one CPU: nothing to split")
    from serve_harness import SECRET, manifest_yaml, start_deployment

    dep = start_deployment(manifest_yaml(mode="disaggregated", runtime={"pin_cores": True}))
    try:
        shares = dict(zip(("prefill", "decode"), split_cpus(host_cpus(), 2), strict=True))
        for name, url in dep.worker_urls().items():
            health = httpx.get(f"{url}/health", headers=worker_headers(SECRET), timeout=30).json()
            own = set(shares[name.split("-")[0]])
            assert _allowed(health["pid"]) == own, name
            assert _allowed(health["core_pid"]) == own, name
        stats = dep.worker_stats()
        assert {s["threads"]["own"] for s in stats.values()} == {len(shares["decode"])}
        r = dep.client().completions.create(
            model="smollm2-135m-instruct", prompt="Count to twenty:", max_tokens=8, temperature=0,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        assert r.usage.completion_tokens == 8
        assert sum(s["threads"]["borrowed_steps"] for s in dep.worker_stats().values()) == 0
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
