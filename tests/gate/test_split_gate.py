"""`splitserve verify` proves the split: on deployments built not to disaggregate (the handoff broken so
that decode recomputes every prompt, the router bypassing the prefill pool, a transfer that moves half
the bytes) it fails, naming the fact; on a correct one the three facts pass. Real deployments of the
default model (router + worker processes)."""

from __future__ import annotations

import asyncio
import os

import httpx
import pytest
import yaml

from splitserve.config import load_manifest
from splitserve.gate.verify import verify_url
from splitserve.runtime.process import start_serve
from splitserve.wire.auth import worker_headers

pytestmark = pytest.mark.slow
SECRET = os.environ.setdefault("SPLITSERVE_KV_SECRET", "splitserve-test-secret-0123456789abcdef")
FACTS = {"prefill pool", "decode recompute", "handoff bytes"}


def _manifest(tmp_path, **sections):
    data = {
        "model": {"max_model_len": 1024},
        "engine": {"kv_cache_mb": 96, "max_num_seqs": 8},
        "server": {"port": 0},
        "verify": {"probe_interval_s": 0, "probe_mb": 4},
        "runtime": {"standby": False},
    }
    for key, value in sections.items():
        data[key] = {**data.get(key, {}), **value}
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump(data))
    return load_manifest(path)


def _facts(report) -> dict[str, tuple[bool, str]]:
    return {c.name: (c.ok, c.detail) for c in report.checks if c.name in FACTS}


def _workers(url: str, role: str) -> list[str]:
    dep = httpx.get(f"{url}/admin/deployment", headers=worker_headers(SECRET), timeout=10).json()
    return [w["url"] for w in dep["workers"] if w["role"] == role]


def _metric(url: str, name: str, selector: str) -> float:
    """The sum of a metric's samples whose labels contain `selector`, from the router's /metrics."""
    text = httpx.get(f"{url}/metrics", timeout=10).text
    lines = [x for x in text.splitlines() if x.startswith(name + "{") and selector in x]
    assert lines, f"{name} {{{selector}}} not exported"
    return sum(float(x.rsplit(" ", 1)[1]) for x in lines)


@pytest.fixture(scope="module")
def correct(tmp_path_factory):
    """One correct deployment for the checks that leave it as it is: the facts are counters' differences
    over probes whose prompts begin with a fresh nonce, so one check's probes never serve another's."""
    with start_serve(_manifest(tmp_path_factory.mktemp("split-gate"))) as sp:
        yield sp


def test_a_correct_deployment_proves_its_split(correct):
    report = asyncio.run(verify_url(correct.url))
    facts = _facts(report)
    assert set(facts) == FACTS, report.table()
    assert all(ok for ok, _ in facts.values()), report.table()
    assert report.ok, report.table()
    assert "recomputed no handed-off prompt" in facts["decode recompute"][1]


def test_a_broken_handoff_under_the_recompute_policy_fails_as_recomputation(tmp_path):
    """The prefill worker's exporter hangs up on every fetch; the `recompute` policy makes the decode
    worker prefill each prompt again: the answers are right, the split is not there."""
    manifest = _manifest(tmp_path, transport={"policy": "recompute"},
                         runtime={"worker_args": ["--enable-fault-injection"]})  # fmt: skip
    with start_serve(manifest) as sp:
        for url in _workers(sp.url, "prefill"):
            r = httpx.post(
                f"{url}/debug/faults", json={"kill": 1.0}, headers=worker_headers(SECRET), timeout=10
            )
            assert r.status_code == 200, r.text
        report = asyncio.run(verify_url(sp.url))
        metrics = _metric(sp.url, "splitserve:kv_recomputed_tokens_total", 'role="decode"')
    assert metrics > 0  # the alert's counter saw it too
    facts = _facts(report)
    assert not report.ok
    ok, detail = facts["decode recompute"]
    assert not ok and detail.startswith("RECOMPUTED: decode workers recomputed"), report.table()
    assert facts["prefill pool"][0], report.table()  # the prefill pool did prefill (then lost the KV)
    assert not facts["handoff bytes"][0] and "no prompt KV was handed off" in facts["handoff bytes"][1]


def test_a_transfer_that_lands_half_the_blocks_fails_on_bytes_per_token(tmp_path):
    manifest = _manifest(tmp_path, runtime={"worker_args": ["--kv-fetch-fraction", "0.5"]})
    with start_serve(manifest) as sp:
        report = asyncio.run(verify_url(sp.url))
        fetched = _metric(sp.url, "splitserve:kv_fetched_bytes_total", 'role="decode"')
        imported = _metric(sp.url, "splitserve:kv_imported_tokens_total", 'role="decode"')
        layout = _metric(sp.url, "splitserve:kv_layout_bytes_per_token", 'role="decode"')
    assert fetched > 0 and imported > 0 and layout == 2 * 30 * 3 * 64 * 4  # the alert's three series
    facts = _facts(report)
    assert not report.ok
    ok, detail = facts["handoff bytes"]
    assert not ok and detail.startswith("SHORT: "), report.table()
    (check,) = (c for c in report.checks if c.name == "handoff bytes")
    layout = 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: K and V, 30 layers, 3 KV heads of 64, fp32: B/token
    assert check.value < 0.75 * layout  # half the blocks (rounded down) of prompts of a few blocks
    assert facts["prefill pool"][0] and facts["decode recompute"][0], report.table()


async def _verify_behind_a_router_that_skips_prefill(url: str):
    """A router in front of the same workers that sends every completion straight to a decode worker's
    /generate (it prefills the prompt itself), as a gateway whose defaults bypass the prefill pool
    would; everything else it passes to the deployment's own router."""
    from aiohttp import ClientSession, web

    headers = worker_headers(SECRET)
    async with ClientSession(headers=headers) as http:
        decode = _workers(url, "decode")[0]

        async def passthrough(request: web.Request) -> web.Response:
            async with http.get(f"{url}{request.path}") as r:
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")

        async def completions(request: web.Request) -> web.Response:
            body = await request.json()
            async with http.post(
                f"{url}/tokenize", json={"model": body["model"], "prompt": body["prompt"]}
            ) as r:
                ids = (await r.json())["tokens"]
            params = {"max_tokens": body["max_tokens"], "temperature": 0, "ignore_eos": True}
            gen = {"prompt_token_ids": ids, "sampling_params": params, "stream": False}
            async with http.post(f"{decode}/generate", json=gen) as r:
                line = await r.json()
            usage = {"prompt_tokens": len(ids), "completion_tokens": len(line["token_ids"])}
            return web.json_response({"choices": [{"index": 0, "text": line["text"]}], "usage": usage})

        app = web.Application()
        app.router.add_get("/admin/deployment", passthrough)
        app.router.add_get("/v1/models", passthrough)
        app.router.add_post("/v1/completions", completions)
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        try:
            return await verify_url(f"http://127.0.0.1:{port}")
        finally:
            await runner.cleanup()


def test_a_router_that_bypasses_the_prefill_pool_fails_as_not_prefilled(correct):
    report = asyncio.run(_verify_behind_a_router_that_skips_prefill(correct.url))
    facts = _facts(report)
    assert not report.ok
    ok, detail = facts["prefill pool"]
    assert not ok and detail.startswith("NOT PREFILLED: the prefill pool computed 0 of"), report.table()
    assert "the router did not send the prompts to the prefill pool" in detail
    assert "no prompt KV was handed off" in facts["handoff bytes"][1]
    assert facts["decode recompute"][0]  # nothing was handed off, so nothing was recomputed
    # the pair checks, which talk to the workers directly, still pass: only the split facts see it
    assert all(c.ok for c in report.checks if c.name in ("round trip", "bandwidth", "handshake"))
