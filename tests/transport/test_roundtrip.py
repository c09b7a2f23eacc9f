"""Round trips between two OS processes: the exporter is a spawned process, the fetcher is this one.

Exact equality of the fetched blocks (different block ids on each side) and of the state tensors,
one release -> exactly one on_free at the exporter, multi-chunk / multi-sendmsg payloads, and a fetcher
in a plain subprocess whose resource tracker must stay quiet about the shm segment it mapped.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import msgspec
import pytest
import torch
from kv_helpers import HAVE_NIXL, NIXL, our_segments, wait_for
from kv_peer import ExporterProcess, PeerSpec, make_kv, make_state

from splitserve.transport import TransportOptions, make_transport

SPEC = PeerSpec(
    num_blocks=160,
    options={"shm_chunk_mb": 1, "checksum": "crc32"},
    backends=("tcp", "shm", "shm-direct", *(("nixl",) if HAVE_NIXL else ())),
)


@pytest.fixture(scope="module")
def exporter():
    proc = ExporterProcess(SPEC)
    yield proc
    proc.stop()


@pytest.fixture
def fetcher():
    made = []

    def make(backend: str, num_blocks: int = 200):
        kv = torch.zeros(make_kv(SPEC, num_blocks=1).shape[1:], dtype=torch.bfloat16).expand(
            num_blocks, -1, -1, -1, -1, -1
        )
        t = make_transport(backend, kv.contiguous(), SPEC.layout(), secret=SPEC.secret)
        made.append(t)
        return t

    yield make
    for t in made:
        t.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", "shm-direct", NIXL])
def test_round_trip_between_processes(exporter, fetcher, backend):
    src_ids, dst_ids = [3, 7, 8, 9, 20], [0, 111, 112, 2, 150]
    freed_before = exporter.freed().count(src_ids)  # the exporter's tcp and shm share one on_free
    handle = exporter.export(backend, f"req-{backend}", src_ids, num_tokens=70)
    assert handle.backend == backend.split("-")[0] and handle.checksum and handle.block_ids == tuple(src_ids)

    t = fetcher(handle.backend)
    state = t.fetch(handle, dst_ids, timeout_s=10)

    expected = make_kv(SPEC)
    assert torch.equal(t.kv_cache[dst_ids], expected[src_ids])
    untouched = [i for i in range(t.kv_cache.shape[0]) if i not in dst_ids]
    assert not t.kv_cache[untouched].any()
    for name, tensor in make_state(SPEC, f"req-{backend}").items():
        assert torch.equal(state[name], tensor), name
    info = t.describe()
    assert info.backend in (handle.backend, "nixl/UCX") and info.peer == handle.address
    assert info.counts["fetches"] == 1 and info.fetch_gbps_last > 0
    assert info.counts["checksums_verified"] == 1

    t.release(handle)
    assert wait_for(lambda: exporter.freed().count(src_ids) > freed_before)
    t.release(handle)  # twice: harmless
    assert exporter.freed().count(src_ids) == freed_before + 1


@pytest.mark.parametrize("backend", ["tcp", "shm", "shm-direct", NIXL])
def test_large_payload_many_chunks_and_reused_connection(exporter, fetcher, backend):
    gen = torch.Generator().manual_seed(7)
    src = torch.randperm(SPEC.num_blocks, generator=gen)[:150].tolist()  # ~2.3 MiB: 3 shm chunks
    src[10:20] = sorted(src[10:20])  # some runs of consecutive ids, some not
    dst = torch.randperm(200, generator=gen)[:150].tolist()
    t = fetcher(backend.split("-")[0])
    for i in range(2):  # the second fetch reuses the pooled connection (and its shm mapping)
        handle = exporter.export(backend, f"big-{backend}-{i}", src, num_tokens=150 * SPEC.block_size)
        t.fetch(handle, dst, timeout_s=20)
        assert torch.equal(t.kv_cache[dst], make_kv(SPEC)[src])
        t.release(handle)
    assert t.describe().connections_opened == 1
    assert not our_segments()


FETCH_SCRIPT = textwrap.dedent(
    """
    import json, sys, msgspec, torch
    sys.path.insert(0, {here!r})
    from kv_peer import PeerSpec, make_kv
    from splitserve.transport import KVHandle, make_transport
    spec = PeerSpec(**json.loads({spec!r}))
    kv = torch.zeros_like(make_kv(spec))
    handle = msgspec.json.decode(sys.stdin.read(), type=KVHandle)
    with make_transport(handle.backend, kv, spec.layout(), secret=spec.secret) as t:
        t.fetch(handle, [1, 2, 3], timeout_s=10)
        t.release(handle)
    print(json.dumps(torch.equal(kv[[1, 2, 3]], make_kv(spec)[[5, 6, 9]])))
    """
)


def test_shm_fetcher_in_a_plain_subprocess_leaves_its_resource_tracker_quiet(make, tmp_path):
    """The fetcher maps a segment it does not own: at its exit, no "leaked shared_memory" warning
    and no unlink behind the exporter's back."""
    spec = PeerSpec(backends=("shm",), state_shapes=())
    freed = []
    t = make_transport("shm", make_kv(spec), spec.layout(), secret=spec.secret, on_free=freed.append,
                       options=TransportOptions())  # fmt: skip
    try:
        handle = t.export("sub", [5, 6, 9], 40)
        from dataclasses import asdict
        from pathlib import Path

        script = FETCH_SCRIPT.format(here=str(Path(__file__).parent), spec=json.dumps(asdict(spec)))
        run = subprocess.run(
            [sys.executable, "-c", script],
            input=msgspec.json.encode(handle).decode(),
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout.strip().splitlines()[-1]) is True
        assert "resource_tracker" not in run.stderr and "leaked" not in run.stderr, run.stderr
        assert freed == [[5, 6, 9]]
    finally:
        t.close()
    assert not our_segments()
