"""The Ray runtime on a real (local) Ray cluster of three nodes (tests/ray/conftest.py): a head with no
model resources, a prefill node and a decode node marked by custom resources; two prefill replicas and
one decode replica, cache-aware routing (router.policy: cache_aware). Greedy output through it equals
the engine's; each replica runs where its placement says; the Ray router follows each prefill replica's
own prefix-cache events as the local router does: prompts that share a system prompt go to the replica
that ran it first, and that replica finds the shared blocks in its cache; a killed decode replica is
replaced by Serve (the `fail` policy: the requests on it end with an error, not migrated). One deployment
for all three (each Serve deployment takes seconds of a small host's CPU to start); the kill comes last."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest

ray = pytest.importorskip("ray")
from splitserve import SamplingParams  # noqa: E402
from splitserve.config import parse_manifest  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
PROMPTS = ["What is the capital of France?", "Write a haiku about the sea."]
SYSTEM_TOKENS = 384  # 24 whole blocks of 16


@pytest.fixture(scope="module")
def deployment(cluster, serve_port):
    from splitserve.runtime import ray_serve

    port = serve_port
    manifest = parse_manifest(f"""
name: raytest
mode: disaggregated
model: {{max_model_len: 1024}}
engine: {{kv_cache_mb: 96, max_num_seqs: 8}}
transport: {{backend: tcp}}
prefill: {{replicas: 2, placement: {{resources: {{prefill_node: 1}}, num_cpus: 0.5}}}}
decode: {{replicas: 1, placement: {{resources: {{decode_node: 1}}, num_cpus: 1}}}}
router: {{policy: cache_aware, cache_aware: {{poll_wait_s: 0.3, stale_s: 1.0}},
         timeouts: {{inter_token_s: 10, kv_transfer_s: 10}}, on_fault: fail}}
server: {{host: 127.0.0.1, port: {port}}}
runtime: {{kind: ray, address: "{cluster.address}", namespace: splitserve-test, health_interval_s: 0.5,
          router_placement: {{resources: {{head: 0.1}}, num_cpus: 0}}}}
""")
    url = ray_serve.deploy(manifest, timeout_s=300)
    yield manifest, url
    ray_serve.undeploy(manifest)


def _admin(url: str) -> dict:
    return httpx.get(f"{url}/admin/deployment", timeout=10).json()


def test_greedy_output_equals_the_engine_and_placement_holds(cluster, deployment, make_smol_llm):
    import openai

    manifest, url = deployment
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    llm = make_smol_llm()
    tok = llm.engine.tokenizer
    for prompt in PROMPTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        want = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=32))
        got = client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": prompt}], temperature=0, max_tokens=32
        )
        assert got.choices[0].message.content == want[0].outputs[0].text
    stream = client.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": PROMPTS[0]}],
        temperature=0,
        max_tokens=16,
        stream=True,
    )
    assert "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
    # where each replica ran: prefill on the prefill node, decode on the decode node, nothing on the head
    nodes = {n["NodeID"]: n["Resources"] for n in ray.nodes() if n["Alive"]}
    workers = _admin(url)["workers"]
    assert sorted(w["role"] for w in workers) == ["decode", "prefill", "prefill"]
    for w in workers:
        assert f"{w['role']}_node" in nodes[w["node_id"]], (w["name"], nodes[w["node_id"]])
        assert "head" not in nodes[w["node_id"]]
        assert w["kv_backend"] == "tcp"


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


def test_shared_prefixes_land_on_the_replica_that_holds_them(deployment):
    _, url = deployment
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


def test_killed_decode_replica_is_replaced(cluster, deployment):
    import openai

    manifest, url = deployment
    before = next(w for w in _admin(url)["workers"] if w["role"] == "decode")
    client = openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)

    async def one() -> tuple[str, float]:
        try:
            s = await client.completions.create(
                model=MODEL,
                prompt="Count slowly:",
                max_tokens=200,
                temperature=0,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            async for _ in s:
                pass
            return "ok", time.monotonic()
        except openai.APIError as exc:
            return type(exc).__name__, time.monotonic()

    async def main() -> tuple[list, float]:
        jobs = [asyncio.create_task(one()) for _ in range(2)]
        await asyncio.sleep(3)
        os.kill(before["pid"], signal.SIGKILL)
        killed = time.monotonic()
        return await asyncio.gather(*jobs), killed

    results, killed = asyncio.run(main())
    failed = [(kind, end - killed) for kind, end in results if kind != "ok"]
    assert failed and all(after < 20 for _, after in failed), results
    deadline = time.monotonic() + 180
    while True:
        decodes = [w for w in _admin(url)["workers"] if w["role"] == "decode" and w["state"] == "ready"]
        if decodes and decodes[0]["pid"] != before["pid"]:
            break
        assert time.monotonic() < deadline, _admin(url)
        time.sleep(1)
    sync = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
    r = sync.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason == "length"
