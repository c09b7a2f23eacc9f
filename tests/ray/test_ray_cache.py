"""Cache-aware routing (router.policy: cache_aware) on the Ray runtime, on the local Ray cluster of
tests/ray/conftest.py: two prefill replicas and one decode replica. The Ray router follows each prefill
replica's own prefix-cache events as the local router does: prompts that share a system prompt go to the
replica that ran it first, and that replica finds the shared blocks in its cache."""

from __future__ import annotations

import random
import time

import httpx
import pytest

from splitserve.config import parse_manifest

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
SYSTEM_TOKENS = 384  # 24 whole blocks of 16


@pytest.fixture(scope="module")
def url(cluster, serve_port):
    from splitserve.runtime import ray_serve

    manifest = parse_manifest(f"""
name: raycache
mode: disaggregated
model: {{max_model_len: 1024}}
engine: {{kv_cache_mb: 96, max_num_seqs: 8}}
transport: {{backend: tcp}}
prefill: {{replicas: 2, placement: {{resources: {{prefill_node: 1}}, num_cpus: 0}}}}
decode: {{replicas: 1, placement: {{resources: {{decode_node: 1}}, num_cpus: 0}}}}
router: {{policy: cache_aware, cache_aware: {{poll_wait_s: 0.3, stale_s: 1.0}}}}
server: {{host: 127.0.0.1, port: {serve_port}}}
runtime: {{kind: ray, address: "{cluster.address}", namespace: splitserve-cache, health_interval_s: 0.5,
          router_placement: {{resources: {{head: 0.1}}, num_cpus: 0}}}}
""")
    yield ray_serve.deploy(manifest, timeout_s=300)
    ray_serve.undeploy(manifest)


def _complete(url: str, prompt: list[int]) -> str:
    """One request; -> the prefill replica that ran it."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    r = httpx.post(f"{url}/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.headers["x-splitserve-prefill-worker"]


def _hits(url: str, worker: str) -> float:
    """The prompt tokens `worker` found in its prefix cache, as the router counts them."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    name = "splitserve:cache_actual_hit_tokens_total{"
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name) and f'worker="{worker}"' in line)  # fmt: skip


def test_shared_prefixes_land_on_the_replica_that_holds_them(url):
    rng = random.Random(7)
    ids = lambda n: [rng.randint(3, 30000) for _ in range(n)]  # noqa: E731
    for _ in range(3):
        system = ids(SYSTEM_TOKENS)
        first = _complete(url, system + ids(16))
        time.sleep(1.2)  # the router's view has the blocks the prefill stored (its events, polled)
        before = _hits(url, first)
        ran = [_complete(url, system + ids(16)) for _ in range(3)]
        assert ran == [first] * 3, (first, ran)
        deadline = time.monotonic() + 20  # /metrics is a snapshot of at most a second ago
        while _hits(url, first) - before < 3 * SYSTEM_TOKENS:
            assert time.monotonic() < deadline, (first, _hits(url, first) - before)
            time.sleep(0.2)
