"""A fetcher drops a dead exporter's shared memory. shm's direct mode maps the exporter's
whole KV cache (a memfd) into the fetcher, held by the pooled connection; a killed prefill worker comes
back at a new address, so nobody takes that connection again; without the pool's reaper, which closes
it, the decode worker would keep the dead worker's cache mapped (about 1 GB) until it restarted."""

from __future__ import annotations

import time
from pathlib import Path

import torch
from kv_peer import ExporterProcess, PeerSpec, make_kv

SPEC = PeerSpec(backends=("shm-direct",))


def _memfd_inodes() -> set[str]:
    """The inodes of the KV memfds this process maps (/proc/self/maps: `... inode /memfd:name`)."""
    lines = Path("/proc/self/maps").read_text().splitlines()
    return {line.split()[4] for line in lines if "memfd:splitserve-kv" in line}


def test_a_dead_exporters_kv_is_unmapped_within_seconds(make):
    before = _memfd_inodes()
    peer = ExporterProcess(SPEC)
    try:
        handle = peer.export("shm-direct", "r1", [2, 3, 4, 5], 64)
        fetcher = make(
            "shm", kv_cache=torch.zeros_like(make_kv(SPEC)), layout=SPEC.layout(), secret=SPEC.secret
        )
        fetcher.fetch(handle, [9, 8, 7, 6], timeout_s=10)
        assert torch.equal(fetcher.kv_cache[[9, 8, 7, 6]], make_kv(SPEC)[[2, 3, 4, 5]])
        theirs = _memfd_inodes() - before
        assert theirs, "the direct-mode fetch mapped the exporter's KV"
    finally:
        peer.proc.kill()  # SIGKILL: no goodbye on the connection, only its end
        peer.proc.join(10)
    deadline = time.monotonic() + 5
    while theirs & _memfd_inodes():
        assert time.monotonic() < deadline, "the dead exporter's KV is still mapped"
        time.sleep(0.1)
    assert fetcher.describe().connections_reaped == 1
