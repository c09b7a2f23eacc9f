"""The router's front gate (router/gate.py): a missing or bad key is a 401 and a client past its rate a
429 with Retry-After, both answered from the headers alone (a body announced but never sent is not
waited for), in OpenAI's error format; each API key has its own bucket. The buckets themselves are
checked with an explicit clock."""

from __future__ import annotations

import socket

import httpx
import pytest
from serve_harness import manifest_yaml, start_deployment

from splitserve.router.gate import TokenBuckets

KEYS = ["sk-gate-one", "sk-gate-two"]


def test_token_buckets_hold_a_burst_and_refill_at_the_rate():
    b = TokenBuckets(rate=2.0, burst=3)
    assert [b.take("a", now=10.0) for _ in range(3)] == [0.0, 0.0, 0.0]
    assert b.take("a", now=10.0) == pytest.approx(0.5)  # empty: the next token in 1 / rate
    assert b.take("b", now=10.0) == 0.0  # another client: its own bucket
    assert b.take("a", now=10.5) == 0.0 and b.take("a", now=10.5) > 0  # one token back after 0.5 s
    assert b.take("a", now=100.0) == 0.0  # refilled, but never past the burst:
    assert [b.take("a", now=100.0) for _ in range(3)][-1] > 0


def test_bucket_table_is_bounded():
    b = TokenBuckets(rate=1.0, burst=1, max_clients=4)
    for i in range(10):
        b.take(i, now=0.0)
    assert len(b._buckets) == 4 and b.take(0, now=0.0) == 0.0  # the oldest was dropped: a fresh bucket


@pytest.fixture(scope="module")
def dep():
    d = start_deployment(
        manifest_yaml(
            mode="colocated",
            model={"source": "random:tiny-chat", "max_model_len": 256},
            engine={"kv_cache_mb": 8},
            server={"port": 0, "api_keys": KEYS, "rate_limit": {"requests_per_s": 0.5, "burst": 3}},
        )
    )
    yield d
    assert d.stop() == 0, "\n".join(d.log)


def _head_only(url: str, headers: str) -> bytes:
    """POST a chat whose body is announced (100 MB) and never sent; -> what the server answers."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as conn:
        conn.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                     f"Content-Length: 100000000\r\n{headers}\r\n".encode())  # fmt: skip
        got = b""
        while b"\r\n\r\n" not in got or not got.rstrip().endswith(b"}"):
            chunk = conn.recv(65536)  # a timeout here: the server waited for the body
            if not chunk:
                break
            got += chunk
    return got


def test_refusals_come_before_the_body(dep):
    got = _head_only(dep.url, "")
    assert got.startswith(b"HTTP/1.1 401") and b'"code": "invalid_api_key"' in got, got
    got = _head_only(dep.url, "Authorization: Bearer sk-wrong\r\n")
    assert got.startswith(b"HTTP/1.1 401"), got


def test_a_client_past_its_rate_gets_429_with_retry_after(dep):
    one = {"Authorization": f"Bearer {KEYS[0]}"}
    codes = [httpx.get(f"{dep.url}/v1/models", headers=one, timeout=10).status_code for _ in range(3)]
    assert codes == [200, 200, 200]
    r = httpx.get(f"{dep.url}/v1/models", headers=one, timeout=10)
    assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert (
        err["code"] == "rate_limit_exceeded"
        and err["type"] == "rate_limit_error"
        and "API key" in err["message"]
    )
    assert _head_only(dep.url, f"Authorization: Bearer {KEYS[0]}\r\n").startswith(b"HTTP/1.1 429")
    two = {"Authorization": f"Bearer {KEYS[1]}"}  # another key: its own bucket
    body = {"model": "random:tiny-chat", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    assert httpx.post(f"{dep.url}/v1/chat/completions", json=body, headers=two, timeout=60).status_code == 200
    assert httpx.get(f"{dep.url}/health", timeout=10).status_code == 200  # never limited
    assert httpx.get(f"{dep.url}/v1/nothing", timeout=10).status_code == 404  # unknown routes as before
