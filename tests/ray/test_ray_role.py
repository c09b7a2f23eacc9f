"""A worker that changes role on the Ray runtime (runtime/ray_role.py), on the local Ray cluster of
tests/ray/conftest.py: one prefill replica and two decode replicas. A change that would leave a role with
no ready worker is refused (409), as is one to the role a worker has (409) or of an unknown worker (404).
While requests stream, a decode replica moves to prefill and back: every stream ends with the greedy
answer of a run with no change, token for token; the replica serves its new role (its own stats say so,
and count the KV it exported or fetched); a call stamped with its old role is answered 409; and
afterwards every KV block is free and no export is leased, on every worker."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
from serve_harness import MODEL, SECRET, stream_tokens

from splitserve.config import parse_manifest
from splitserve.wire.auth import worker_headers

ray = pytest.importorskip("ray")

pytestmark = pytest.mark.slow
PROMPTS = [f"Count from {i} to {i + 40}, separated by commas:" for i in range(3)]
MAX_TOKENS = 16
WORKER = worker_headers(SECRET)  # the deployment's workers take the harness's KV secret (its env)


@pytest.fixture(scope="module")
def url(cluster, serve_port):
    from splitserve.runtime import ray_serve

    manifest = parse_manifest(f"""
name: rayrole
mode: disaggregated
model: {{max_model_len: 1024}}
engine: {{kv_cache_mb: 64, max_num_seqs: 8}}
transport: {{backend: tcp}}
prefill: {{replicas: 1, placement: {{resources: {{prefill_node: 1}}, num_cpus: 0}}}}
decode: {{replicas: 2, placement: {{resources: {{decode_node: 1}}, num_cpus: 0}}}}
router: {{timeouts: {{inter_token_s: 20, kv_transfer_s: 20, prefill_s: 30}}}}
server: {{host: 127.0.0.1, port: {serve_port}}}
runtime: {{kind: ray, address: "{cluster.address}", namespace: splitserve-role, health_interval_s: 0.5,
          router_placement: {{resources: {{head: 0.1}}, num_cpus: 0}}}}
""")
    yield ray_serve.deploy(manifest, timeout_s=300)
    ray_serve.undeploy(manifest)


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


def test_refusals(url):
    workers = _workers(url)
    prefill = next(n for n, w in workers.items() if w["role"] == "prefill")
    decode = next(n for n, w in workers.items() if w["role"] == "decode")
    r = _switch(url, prefill, role="decode")
    assert r.status_code == 409 and r.json()["error"]["code"] == "role_change_refused", r.text
    assert "last ready prefill worker" in r.json()["error"]["message"]
    assert _switch(url, decode, role="decode").status_code == 409  # its role already
    assert _switch(url, "nobody-0", role="prefill").status_code == 404


def test_a_decode_replica_serves_prefill_and_back_under_load(url):
    ref = []
    for prompt in PROMPTS:  # the greedy answers before any change
        r = httpx.post(f"{url}/v1/completions", json=_body(prompt, False), timeout=120)
        ref.append(r.json()["choices"][0]["logprobs"]["tokens"])
    name = sorted(n for n, w in _workers(url).items() if w["role"] == "decode")[-1]
    answers: list[tuple[int, str, list[str]]] = []

    async def load(client: httpx.AsyncClient, stop: asyncio.Event, k: int) -> None:
        while not stop.is_set():
            outcome, tokens = await _stream(client, url, PROMPTS[k % len(PROMPTS)])
            answers.append((k % len(PROMPTS), outcome, tokens))
            k += 1

    async def serving(role: str) -> None:
        """Until the switched replica's own stats show it serving `role` (KV exported, or fetched)."""
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
            for epoch, role in enumerate(("prefill", "decode"), start=1):
                change = {"role": role, "reason": "test", "drain_timeout_s": 30.0}
                r = await client.post(f"{url}/admin/workers/{name}/role", json=change)
                assert r.status_code == 200, r.text
                assert (r.json()["to_role"], r.json()["epoch"]) == (role, epoch), r.json()
                w = (await asyncio.to_thread(_workers, url))[name]
                assert (w["role"], w["role_epoch"], w["state"]) == (role, epoch, "ready"), w
                await serving(role)
                if role == "prefill":  # a call stamped with its old role and epoch
                    body = {"prompt_token_ids": [1, 2, 3], "stamp": {"role": "decode", "epoch": 0}}
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
