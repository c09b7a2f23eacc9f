"""The scaling controller on a real local Ray cluster (tests/ray/conftest.py: a head with no model
resources, a prefill node and a decode node, each with room for two replicas). The SLOs (TTFT 5 ms, ITL
1 ms) are under one model step of the tiny model on any CPU, so every request breaks them, and the load
sets which figures are judged (at least `min_requests` per window): a prompt-heavy load makes Serve add
a prefill replica, an output-heavy one a decode replica; a trickle slower than `min_requests` per
window judges neither, and both are drained and removed. Each step may take the signals' delays plus
three times the deployment's own measured start. Every answer, across every change, is the engine's
greedy answer."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

ray = pytest.importorskip("ray")

from splitserve import SamplingParams  # noqa: E402
from splitserve.config import parse_manifest  # noqa: E402

pytestmark = pytest.mark.slow
MODEL = "smollm2-135m-instruct"
LONG = [f"Item {i}: " + "the quick brown fox jumps over the lazy dog. " * 10 for i in range(4)]  # ~110 tokens
SHORT = [f"Count from {i} upwards:" for i in range(4)]
WINDOW_S, MIN_REQUESTS = 3, 3
TRICKLE_S = 1.5 * WINDOW_S / MIN_REQUESTS  # under MIN_REQUESTS first tokens in any window
SIGNALS_S = 20  # a window to fill, the cooldown, a few intervals


@pytest.fixture(scope="module")
def deployment(cluster, serve_port):
    from splitserve.runtime import ray_serve

    port = serve_port
    manifest = parse_manifest(f"""
name: rayscale
mode: disaggregated
model: {{max_model_len: 1024}}
engine: {{kv_cache_mb: 64, max_num_seqs: 8, enable_prefix_caching: false}}
transport: {{backend: tcp}}
prefill: {{replicas: 1, min_replicas: 1, max_replicas: 2,
          placement: {{resources: {{prefill_node: 1}}, num_cpus: 0}}}}
decode: {{replicas: 1, min_replicas: 1, max_replicas: 2,
         placement: {{resources: {{decode_node: 1}}, num_cpus: 0}}}}
router: {{timeouts: {{inter_token_s: 30, kv_transfer_s: 30, prefill_s: 60}}}}
scaling: {{enabled: true, interval_s: 1, window_s: {WINDOW_S}, cooldown_s: 2, down_after_s: 3, ttft_ms: 5,
          itl_ms: 1, min_requests: {MIN_REQUESTS}, max_waiting_per_replica: 1000, drain_timeout_s: 20}}
server: {{host: 127.0.0.1, port: {port}}}
runtime: {{kind: ray, address: "{cluster.address}", namespace: splitserve-scale, health_interval_s: 0.5,
          router_placement: {{resources: {{head: 0.1}}, num_cpus: 0}}}}
""")
    start = time.monotonic()
    url = ray_serve.deploy(manifest, timeout_s=300)
    yield url, time.monotonic() - start
    ray_serve.undeploy(manifest)


def _workers(url: str) -> list[dict]:
    return httpx.get(f"{url}/admin/deployment", timeout=10).json()["workers"]


def _ready(url: str, role: str) -> int:
    return sum(w["role"] == role and w["state"] == "ready" for w in _workers(url))


def _decisions(url: str, holds: bool = False) -> dict[tuple[str, str, str], float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(httpx.get(f"{url}/metrics", timeout=10).text):
        for s in fam.samples:
            if s.name == "splitserve:scaling_decisions_total" and (holds or s.labels["action"] != "hold"):
                out[(s.labels["role"], s.labels["action"], s.labels["reason"])] = s.value
    return out


async def _load(url: str, prompts: list[list[int]], max_tokens: int, until, answers: list, workers: int,
                timeout_s: float, pause_s: float = 0.0) -> None:  # fmt: skip
    end = time.monotonic() + timeout_s
    async with httpx.AsyncClient(timeout=120) as client:

        async def one(k: int) -> None:
            i = k
            while not await asyncio.to_thread(until):
                if time.monotonic() > end:
                    pytest.fail(f"no new shape in {timeout_s:.0f}s: {_workers(url)}, {_decisions(url, True)}")
                body = {"model": MODEL, "prompt": prompts[i % len(prompts)], "max_tokens": max_tokens,
                        "temperature": 0}  # fmt: skip
                r = await client.post(f"{url}/v1/completions", json=body)
                answers.append((i % len(prompts), max_tokens, r.status_code, r.json()))
                i += workers
                await asyncio.sleep(pause_s)

        await asyncio.gather(*(one(k) for k in range(workers)))


def test_controller_drives_serve_replicas_up_and_down(deployment, make_smol_llm):
    url, start_s = deployment
    step_s = SIGNALS_S + 3 * start_s  # what one change of shape may take: a replica starts as slowly
    llm = make_smol_llm()
    tok = llm.engine.tokenizer
    long_ids, short_ids = [tok.encode(p) for p in LONG], [tok.encode(p) for p in SHORT]
    want = {
        n: [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": i} for i in ids],
                                                    SamplingParams(temperature=0, max_tokens=n))]
        for n, ids in ((1, long_ids), (24, short_ids))
    }  # fmt: skip
    answers: list = []
    asyncio.run(_load(url, long_ids, 1, lambda: _ready(url, "prefill") == 2, answers, 4, step_s))
    assert _ready(url, "decode") == 1
    asyncio.run(_load(url, short_ids, 24, lambda: _ready(url, "decode") == 2, answers, 3, step_s))
    assert _ready(url, "prefill") == 2
    # both extra replicas drained, stopped and gone from the router's view
    shrunk = lambda: sorted((w["role"], w["state"]) for w in _workers(url)) == [  # noqa: E731
        ("decode", "ready"), ("prefill", "ready")]  # fmt: skip
    asyncio.run(_load(url, long_ids, 1, shrunk, answers, 1, 2 * step_s, pause_s=TRICKLE_S))
    bad = [(i, n, status, body) for i, n, status, body in answers
           if status != 200 or body["choices"][0]["text"] != want[n][i]]  # fmt: skip
    assert not bad and len(answers) > 10, bad[:3]
    assert _decisions(url) == {
        ("prefill", "add", "ttft_slo"): 1,
        ("decode", "add", "itl_slo"): 1,
        ("prefill", "remove", "low_load"): 1,
        ("decode", "remove", "low_load"): 1,
    }
