"""SmolLM2, prefill and decode in separate OS processes over tcp and shm: the disaggregated output
equals the colocated one token for token (greedy and seeded sampling), requests joining a decode
batch concurrently; afterwards both block pools are full and the transfers are counted.

SmolLM2 over nixl is tests/gate/test_verify.py's fallback deployment (its round trip: greedy, separate
processes, token for token, nixl/UCX over CPU memory); concurrent imports over nixl are
test_disaggregated_qwen3_5's. A third SmolLM2 pair here cost CI ~50 s and showed nothing more."""

from __future__ import annotations

import pytest
from kv_transfer_helpers import (
    WorkerProcess,
    assert_pools_full,
    disaggregated,
    in_parallel,
    running,
    start_workers,
)

pytestmark = pytest.mark.slow

SMOL_ARGS = ("--max-model-len", "1024", "--kv-cache-mb", "48", "--max-num-seqs", "8")
GREEDY = {"temperature": 0, "max_tokens": 24}
SEEDED = [{"temperature": 0.8, "top_p": 0.95, "seed": 100 + i, "max_tokens": 24} for i in range(4)]


@pytest.fixture(scope="module", params=["tcp", "shm"])
def pair(request):
    backend = request.param
    p = WorkerProcess("prefill", *SMOL_ARGS, backend=backend)
    d = WorkerProcess("decode", *SMOL_ARGS, backend=backend)
    start_workers(p, d)
    yield backend, p, d
    p.stop()
    d.stop()


def test_greedy_equals_colocated(pair, smol_chat_prompts):
    backend, p, d = pair
    colocated = in_parallel(lambda ids: d.generate(ids, GREEDY), smol_chat_prompts)
    transferred = in_parallel(lambda ids: disaggregated(p, d, ids, GREEDY), smol_chat_prompts)
    assert transferred == colocated
    assert all(len(t) > 1 for t in transferred)
    assert_pools_full(p, d)
    kv = d.stats()["kv_transfer"]
    assert kv["backend"] == kv["transport"]["requested"] == running(backend)
    assert kv["counts"]["fetches"] >= len(smol_chat_prompts) and kv["counts"]["fetched_bytes"] > 0
    assert not kv["failures"]
    if backend == "shm":  # the prefill worker's cache is a memfd: fetchers copy straight out of it
        assert p.stats()["kv_transfer"]["transport"]["shm_mode"] == "direct"


def test_seeded_sampling_equals_colocated(pair, smol_chat_prompts):
    _, p, d = pair
    cases = list(zip(smol_chat_prompts, SEEDED, strict=True))
    colocated = in_parallel(lambda c: d.generate(*c), cases)
    transferred = in_parallel(lambda c: disaggregated(p, d, *c), cases)
    assert transferred == colocated
    assert_pools_full(p, d)


def test_an_idle_keep_alive_connection_outlives_the_clients_expiry(pair):
    """Workers keep an idle connection open past the 5 s after which httpx clients stop reusing one
    (listen.KEEP_ALIVE_S). With both at 5 s a client could send on a connection in the instant the
    worker closes it and get "connection reset by peer" (this module's tests did, once, in CI)."""
    import socket
    import time
    from urllib.parse import urlsplit

    backend, p, _ = pair
    if backend != "tcp":
        pytest.skip("one worker is enough")
    url = urlsplit(p.info["url"])
    request = f"GET /health HTTP/1.1\r\nHost: {url.hostname}\r\n\r\n".encode()
    with socket.create_connection((url.hostname, url.port), timeout=10) as sock:
        stream = sock.makefile("rb")
        for attempt in range(2):
            if attempt:
                time.sleep(6)  # idle past the client's 5 s, then the same connection again
            sock.sendall(request)
            status = stream.readline()
            assert status.startswith(b"HTTP/1.1 200"), f"the worker closed the idle connection: {status!r}"
            length = 0
            while (line := stream.readline()) not in (b"\r\n", b""):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":")[1])
            assert len(stream.read(length)) == length  # the whole answer: the next starts clean
