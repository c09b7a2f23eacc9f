"""A worker that changes role at run time (runtime/role_switch.py), through a real disaggregated deployment
of two prefill workers and one decode worker. First, `prefill-1`'s role epoch changes behind the router's
back: the requests the router sends it under the old epoch are answered 409 and picked again, and every
answer is still right. Then `prefill-1` moves to decode and back while requests stream, ten times:
every stream ends "ok" with the greedy answer of a run with no change, token for token (those still on
the worker when a short drain ends migrate); the worker serves its new role (its own stats say so, and
count the KV it exported or fetched); a call stamped with its old role or epoch is answered 409; a
change that would leave a role with no ready worker is refused; and afterwards every KV block is free
and no export is leased, on every worker."""

from __future__ import annotations

import asyncio
import re

import httpx
import pytest
import yaml
from serve_harness import MODEL, SECRET, manifest_yaml, start_deployment, stream_tokens

from splitserve.config import parse_manifest
from splitserve.runtime.role_switch import switched_config
from splitserve.wire.auth import worker_headers

pytestmark = pytest.mark.slow

KEY = "sk-role-test"
PROMPTS = [f"Count from {i} to {i + 40}, separated by commas:" for i in range(3)]
MAX_TOKENS = 16
SWITCHES = 10
SHORT_DRAINS = (3, 7)  # changes from decode whose drain is too short for its streams: those migrate
MANIFEST = manifest_yaml(
    mode="disaggregated",
    prefill={"replicas": 2},
    decode={"replicas": 1},
    router={"timeouts": {"inter_token_s": 20, "kv_transfer_s": 20, "prefill_s": 30}},
)


@pytest.fixture(scope="module")
def dep():
    d = start_deployment(MANIFEST, api_key=KEY)
    yield d
    assert d.stop() == 0, "\n".join(d.log)


@pytest.fixture(scope="module")
def ref(dep) -> list[list[str]]:
    """The greedy answers' tokens, one request at a time, before any role changes."""
    return _reference(dep)


def _body(prompt: str, stream: bool) -> dict:
    return {"model": MODEL, "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "stream": stream,
            "ignore_eos": True, "logprobs": 0}  # fmt: skip


def _reference(dep) -> list[list[str]]:
    out = []
    for prompt in PROMPTS:
        r = httpx.post(
            f"{dep.url}/v1/completions", json=_body(prompt, False), headers=dep.headers(), timeout=60
        )
        r.raise_for_status()
        out.append(r.json()["choices"][0]["logprobs"]["tokens"])
    return out


async def _stream(client: httpx.AsyncClient, url: str, prompt: str) -> tuple[str, list[str]]:
    return await stream_tokens(client, url, _body(prompt, True))


def _switch(dep, name: str, **body) -> httpx.Response:
    return httpx.post(f"{dep.url}/admin/workers/{name}/role", json=body, headers=dep.headers(), timeout=120)


def _worker(dep, name: str) -> dict:
    return {w["name"]: w for w in dep.admin()["workers"]}[name]


def _metric(dep, name: str, label: str = "") -> float:
    """The sum of `name`'s series (those whose labels hold `label`)."""
    text = httpx.get(f"{dep.url}/metrics", params={"fresh": 1}, headers=dep.headers(), timeout=10).text
    pattern = rf"^{name}(?:{{[^}}]*}})? (\S+)$" if not label else rf"^{name}{{[^}}]*{label}[^}}]*}} (\S+)$"
    return sum(float(x) for x in re.findall(pattern, text, re.M))


def test_a_worker_whose_epoch_changed_unseen_is_picked_again(dep, ref):
    w = _worker(dep, "prefill-1")
    assert (w["role"], w["role_epoch"]) == ("prefill", 0), w
    # the worker's own role change, which the router does not hear of: its view stays at epoch 0
    manifest = parse_manifest(yaml.safe_dump(MANIFEST), "test manifest", {"server.api_keys": [KEY]})
    spec = switched_config(manifest, "prefill-1", "prefill", 7, None).to_json(include_secret=False)
    r = httpx.post(f"{w['url']}/role", json={"spec": spec}, headers=worker_headers(SECRET), timeout=120)
    assert r.status_code == 200 and r.json()["role_epoch"] == 7, r.text
    repicks = _metric(dep, "splitserve:request_repicks_total")

    async def main() -> list:
        async with httpx.AsyncClient(timeout=120, headers=dep.headers()) as client:
            return await asyncio.gather(*(_stream(client, dep.url, p) for p in PROMPTS + PROMPTS))

    for (outcome, tokens), expected in zip(asyncio.run(main()), ref + ref, strict=True):
        assert outcome == "ok" and tokens == expected, (outcome, tokens, expected)
    assert _metric(dep, "splitserve:request_repicks_total") > repicks


def test_role_switches_under_streaming_load_lose_nothing(dep, ref):
    answers: list[tuple[int, str, list[str]]] = []  # (prompt, outcome, tokens) of every stream

    async def one(client: httpx.AsyncClient, k: int) -> None:
        outcome, tokens = await _stream(client, dep.url, PROMPTS[k % len(PROMPTS)])
        answers.append((k % len(PROMPTS), outcome, tokens))

    async def load(client: httpx.AsyncClient, stop: asyncio.Event, k: int) -> None:
        """One client's streams, one after another, until `stop`."""
        while not stop.is_set():
            await one(client, k)
            k += 1

    async def serving(role: str) -> dict:
        """Until prefill-1's own stats show it serving `role` (KV exported, or fetched); -> the stats."""
        key = "exports" if role == "prefill" else "fetches"
        for _ in range(300):
            s = (await asyncio.to_thread(dep.worker_stats))["prefill-1"]
            if s["role"] == role and s["kv_transfer"]["counts"].get(key):
                return s
            await asyncio.sleep(0.05)
        raise AssertionError(f"prefill-1 did not serve as {role}: {s}")

    async def streaming_on(name: str) -> None:
        for _ in range(200):
            if (await asyncio.to_thread(dep.worker_stats))[name]["running"]:
                return
            await asyncio.sleep(0.02)
        raise AssertionError(f"no stream reached {name}")

    async def main() -> None:
        async with httpx.AsyncClient(timeout=120, headers=dep.headers()) as client:
            stop = asyncio.Event()
            loaders = [asyncio.create_task(load(client, stop, k)) for k in range(2)]
            bursts: list[asyncio.Task] = []
            await asyncio.sleep(0.5)  # the streams are under way
            for i in range(SWITCHES):
                role = "decode" if i % 2 == 0 else "prefill"
                change = {"role": role, "reason": "test", "drain_timeout_s": 30.0}
                if i in SHORT_DRAINS:  # a burst, and the change once a stream runs on the worker
                    bursts += [asyncio.create_task(one(client, k)) for k in range(len(PROMPTS))]
                    await streaming_on("prefill-1")
                    change["drain_timeout_s"] = 0.01
                r = await client.post(f"{dep.url}/admin/workers/prefill-1/role", json=change)
                assert r.status_code == 200, r.text
                done = r.json()
                assert (done["to_role"], done["epoch"], done["reason"]) == (role, i + 1, "test"), done
                assert min(done["drain_s"], done["reconfigure_s"], done["rejoin_s"]) >= 0, done
                # a burst at once, beside the steady load: the least loaded pick spreads it over the pool
                bursts += [asyncio.create_task(one(client, k)) for k in range(len(PROMPTS))]
                await serving(role)
                w = await asyncio.to_thread(_worker, dep, "prefill-1")
                assert (w["role"], w["role_epoch"], w["state"]) == (role, i + 1, "ready"), w
            stop.set()
            await asyncio.gather(*loaders, *bursts)

    asyncio.run(main())
    assert len(answers) > SWITCHES, len(answers)
    for prompt, outcome, tokens in answers:
        assert outcome == "ok" and tokens == ref[prompt], (outcome, tokens, ref[prompt])
    assert _metric(dep, "splitserve:request_migrations_total", 'cause="role_changed"') > 0
    stats = dep.wait_idle(timeout_s=30)
    for name, s in stats.items():
        leases = s["kv_transfer"]["transport"]["leases"]["active"]
        assert (s["unfinished"], s["blocks"]["free"], leases) == (0, s["blocks"]["total"], 0), (name, s)
    assert _metric(dep, "splitserve:worker_role_changes_total") == SWITCHES
    assert _metric(dep, "splitserve:worker_role_change_seconds_count") == SWITCHES * 3  # three phases each
    assert f"changed role decode -> prefill (epoch {SWITCHES}, reason: test)" in "\n".join(dep.log)


def test_a_call_stamped_with_a_stale_role_gets_409(dep):
    w = _worker(dep, "prefill-1")
    epoch, url = w["role_epoch"], w["url"]
    assert w["role"] == "prefill", w  # an even number of changes above
    h = worker_headers(SECRET)
    stale_epoch = epoch - 1 if epoch else epoch + 1
    handle = {"backend": "tcp", "address": "127.0.0.1:1", "request_id": "x", "lease_id": "x",
              "block_ids": [0], "num_tokens": 1, "layout_fingerprint": "x",
              "lease_expires_at": 0.0}  # fmt: skip
    for path, body in (
        ("/prefill", {"prompt_token_ids": [1, 2, 3]}),
        ("/kv/release", {"kv_export": {"handle": handle}}),
    ):
        for stamp in ({"role": "decode", "epoch": epoch}, {"role": "prefill", "epoch": stale_epoch}):
            r = httpx.post(f"{url}{path}", json={**body, "stamp": stamp}, headers=h, timeout=30)
            assert r.status_code == 409, (path, stamp, r.text)
            err = r.json()["error"]
            assert (err["type"], err["code"], err["role"], err["epoch"]) == (
                "stale_role",
                "stale_role",
                "prefill",
                epoch,
            )
    fresh = {"prompt_token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1},
             "stamp": {"role": "prefill", "epoch": epoch}}  # fmt: skip
    r = httpx.post(f"{url}/prefill", json=fresh, headers=h, timeout=30)
    assert r.status_code == 200 and r.json()["kv_export"] is None, r.text  # max_tokens 1: nothing leased


def test_a_change_that_leaves_a_role_unserved_is_refused(dep):
    decode = [w["name"] for w in dep.admin()["workers"] if w["role"] == "decode" and w["state"] == "ready"]
    if len(decode) == 1:
        r = _switch(dep, decode[0], role="prefill")
        assert r.status_code == 409 and r.json()["error"]["code"] == "role_change_refused", r.text
        assert "last ready decode worker" in r.json()["error"]["message"]
    assert _switch(dep, "prefill-0", role="prefill").status_code == 409  # its role already
    assert _switch(dep, "nobody-0", role="decode").status_code == 404
    assert _switch(dep, "prefill-0", role="colocated").status_code == 400
    r = httpx.post(f"{dep.url}/admin/workers/prefill-0/role", json={"role": "decode"}, timeout=10)
    assert r.status_code == 401
    assert dep.health()["status"] == "ok"
