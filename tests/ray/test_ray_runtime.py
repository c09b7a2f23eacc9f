"""The Ray runtime on a real (local) Ray cluster of three nodes (tests/ray/conftest.py): a head with no
model resources, a prefill node and a decode node marked by custom resources. Greedy output through it
equals the engine's; each replica runs where its placement says; a killed decode replica is replaced by
Serve."""

from __future__ import annotations

import asyncio
import os
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


@pytest.fixture(scope="module")
def deployment(cluster, serve_port):
    from splitserve.runtime import ray_serve

    port = serve_port
    manifest = parse_manifest(f"""
name: raytest
mode: disaggregated
model: {{max_model_len: 1024}}
engine: {{kv_cache_mb: 64, max_num_seqs: 8}}
transport: {{backend: tcp}}
prefill: {{replicas: 1, placement: {{resources: {{prefill_node: 1}}, num_cpus: 1}}}}
decode: {{replicas: 1, placement: {{resources: {{decode_node: 1}}, num_cpus: 1}}}}
router: {{timeouts: {{inter_token_s: 10, kv_transfer_s: 10}}, on_fault: fail}}
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
    assert {w["role"] for w in workers} == {"prefill", "decode"}
    for w in workers:
        assert f"{w['role']}_node" in nodes[w["node_id"]], (w["name"], nodes[w["node_id"]])
        assert "head" not in nodes[w["node_id"]]
        assert w["kv_backend"] == "tcp"


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
