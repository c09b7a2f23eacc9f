"""The Ray runtime on a real (local) Ray cluster of three nodes (tests/ray/conftest.py): a head with no
model resources, a prefill node and a decode node marked by custom resources; two prefill replicas and
one decode replica, cache-aware routing (router.policy: cache_aware). Greedy output through it equals
the engine's; each replica runs where its placement says; the Ray router follows each prefill replica's
own prefix-cache events as the local router does: prompts that share a system prompt go to the replica
that ran it first, and that replica finds the shared blocks in its cache.

A worker changes role on it (runtime/ray_role.py): a change that would leave a role with no ready worker
is refused (409), as is one to the role a worker has (409) or of an unknown worker (404). While requests
stream, a prefill replica moves to decode and back: every stream ends with the greedy answer of a run
with no change, token for token; the replica serves its new role (its own stats say so, and count the
KV it fetched or exported); a call stamped with its old role is answered 409; and afterwards every KV
block is free and no export is leased, on every worker.

Last, a killed decode replica is replaced by Serve (the `fail` policy: the requests on it end with an
error, not migrated). One deployment for all of it (each Serve deployment takes seconds of a small
host's CPU to start and to delete)."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time

import httpx
import pytest
from serve_harness import SECRET, stream_tokens

ray = pytest.importorskip("ray")
from splitserve import SamplingParams  # noqa: E402
from splitserve.config import parse_manifest  # noqa: E402
from splitserve.wire.auth import worker_headers  # noqa: E402

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


ROLE_PROMPTS = [f"Count from {i} to {i + 40}, separated by commas:" for i in range(3)]
MAX_TOKENS = 16
WORKER = worker_headers(SECRET)  # the deployment's workers take the harness's KV secret (its env)


def _body(prompt: str, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip


def _workers(url: str) -> dict[str, dict]:
    return {w["name"]: w for w in httpx.get(f"{url}/admin/deployment", timeout=10).json()["workers"]}


def _stats(worker: dict) -> dict:
    return httpx.get(f"{worker['url']}/stats", headers=WORKER, timeout=60).json()


def _switch(url: str, name: str, **body) -> httpx.Response:
    return httpx.post(f"{url}/admin/workers/{name}/role", json=body, timeout=120)


async def _stream(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, list[str]]:
    return await stream_tokens(client, url, _body(prompt, True))


def test_refusals(deployment):
    _, url = deployment
    workers = _workers(url)
    prefill = next(n for n, w in workers.items() if w["role"] == "prefill")
    decode = next(n for n, w in workers.items() if w["role"] == "decode")
    r = _switch(url, decode, role="prefill")
    assert r.status_code == 409 and r.json()["error"]["code"] == "role_change_refused", r.text
    assert "last ready decode worker" in r.json()["error"]["message"]
    assert _switch(url, prefill, role="prefill").status_code == 409  # its role already
    assert _switch(url, "nobody-0", role="decode").status_code == 404


def test_a_prefill_replica_serves_decode_and_back_under_load(deployment):
    _, url = deployment
    ref = []
    for prompt in ROLE_PROMPTS:  # the greedy answers before any change
        r = httpx.post(f"{url}/v1/completions", json=_body(prompt, False), timeout=120)
        ref.append(r.json()["choices"][0]["logprobs"]["tokens"])
    name = sorted(n for n, w in _workers(url).items() if w["role"] == "prefill")[-1]
    answers: list[tuple[int, str, list[str]]] = []

    async def load(client: httpx.AsyncClient, stop: asyncio.Event, k: int) -> None:
        while not stop.is_set():
            outcome, tokens = await _stream(client, url, ROLE_PROMPTS[k % len(ROLE_PROMPTS)])
            answers.append((k % len(ROLE_PROMPTS), outcome, tokens))
            k += 1

    async def serving(role: str) -> None:
        """Until the switched replica's own stats show it serving `role` (KV fetched, or exported)."""
        key = "exports" if role == "prefill" else "fetches"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            s = await asyncio.to_thread(_stats, _workers(url)[name])
            if s["role"] == role and s["kv_transfer"]["counts"].get(key):
                return
            await asyncio.sleep(0.1)
        raise AssertionError(f"{name} did not serve as {role}: {s}")

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120) as client:
            stop = asyncio.Event()
            loaders = [asyncio.create_task(load(client, stop, k)) for k in range(3)]
            await asyncio.sleep(1.0)  # the streams are under way
            for epoch, role in enumerate(("decode", "prefill"), start=1):
                change = {"role": role, "reason": "test", "drain_timeout_s": 30.0}
                r = await client.post(f"{url}/admin/workers/{name}/role", json=change)
                assert r.status_code == 200, r.text
                assert (r.json()["to_role"], r.json()["epoch"]) == (role, epoch), r.json()
                w = (await asyncio.to_thread(_workers, url))[name]
                assert (w["role"], w["role_epoch"], w["state"]) == (role, epoch, "ready"), w
                await serving(role)
                if role == "decode":  # a call stamped with its old role and epoch
                    body = {"prompt_token_ids": [1, 2, 3], "stamp": {"role": "prefill", "epoch": 0}}
                    r = await client.post(f"{w['url']}/prefill", json=body, headers=WORKER)
                    assert r.status_code == 409 and r.json()["error"]["code"] == "stale_role", r.text
            stop.set()
            await asyncio.gather(*loaders)

    asyncio.run(main())
    assert len(answers) > 3, answers
    for prompt, outcome, tokens in answers:
        assert outcome == "ok" and tokens == ref[prompt], (outcome, tokens, ref[prompt])
    deadline = time.monotonic() + 30
    while True:  # idle: nothing unfinished, every block free, no export leased
        busy = {}
        for n, w in _workers(url).items():
            s = _stats(w)
            leases = s["kv_transfer"]["transport"]["leases"]["active"]
            if (s["unfinished"], s["blocks"]["free"], leases) != (0, s["blocks"]["total"], 0):
                busy[n] = s
        if not busy:
            break
        assert time.monotonic() < deadline, busy
        time.sleep(0.5)


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
