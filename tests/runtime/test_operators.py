"""Operators' habits, on real deployments: `splitserve serve MODEL` with vLLM's flags and a manifest with
vLLM's names each reach the engine (read back from /health); the access log and the stats line under
load; a burst of 4xx answers in /metrics and in the log; JSON log lines; the workers' vLLM-named
/metrics (what the Gateway API Inference Extension scrapes), speculative decoding's counters among them."""

from __future__ import annotations

import asyncio
import json
import re
import tempfile
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from serve_harness import SECRET

from splitserve.model.loader import default_model_path
from splitserve.runtime.process import ServeProcess, start_serve
from splitserve.wire.auth import worker_headers

GGUF = str(default_model_path())
KEY = "sk-operators"


def _engine(url: str) -> dict:
    health = httpx.get(f"{url}/health", timeout=10).json()
    assert health["status"] == "ok", health
    (worker,) = health["workers"]
    return worker["engine"]


def _samples(text: str) -> dict[tuple[str, frozenset], float]:
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for fam in text_string_to_metric_families(text)
        for s in fam.samples
    }


def _errors(url: str, status: str) -> float:
    # the next snapshot (taken after the burst); this deployment's /metrics wants the key (metrics_auth)
    text = httpx.get(f"{url}/metrics?fresh=1", headers={"Authorization": f"Bearer {KEY}"}, timeout=10).text
    for (name, labels), value in _samples(text).items():
        if name == "splitserve:request_errors_total" and dict(labels)["status"] == status:
            return value
    raise AssertionError(f"no request_errors_total sample for status {status}")


@pytest.fixture(scope="module")
def vllm_flags() -> ServeProcess:
    """`splitserve serve MODEL` as `vllm serve MODEL` is typed; the key from SPLITSERVE_API_KEY."""
    args = [
        GGUF, "--mode", "colocated", "--port", "0", "--max-model-len", "1024",
        "--gpu-memory-utilization", "0.5", "--max-num-seqs", "6", "--max-num-batched-tokens", "512",
        "--block-size", "32", "--no-enable-prefix-caching", "--enforce-eager", "--seed", "11",
        "--tokenizer", GGUF, "--served-model-name", "tiny", "tiny-alias", "--tensor-parallel-size", "1",
        "--log-format", "json", "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
    ]  # fmt: skip
    sp = start_serve(None, 180, args=args, env={"SPLITSERVE_API_KEY": KEY})
    yield sp
    assert sp.stop() == 0, "\n".join(sp.log)


@pytest.fixture(scope="module")
def vllm_manifest() -> ServeProcess:
    """A manifest written with vLLM's field names; a short stats interval; /metrics behind the key."""
    manifest = {
        "mode": "colocated",
        "model": {"source": GGUF, "tokenizer": GGUF, "served_model_name": ["mani", "mani-2"],
                  "max_model_len": 1024, "tensor_parallel_size": 1},
        "engine": {"gpu_memory_utilization": 0.4, "max_num_seqs": 5, "max_num_batched_tokens": 256,
                   "block_size": 16, "enable_prefix_caching": False, "enforce_eager": True, "seed": 3},
        "server": {"port": 0, "api_keys": [KEY], "log_stats_interval_s": 1, "metrics_auth": True},
    }  # fmt: skip
    path = Path(tempfile.mkdtemp(prefix="splitserve-test-")) / "vllm-names.yaml"
    path.write_text(yaml.safe_dump(manifest))
    sp = start_serve(None, 180, args=[str(path)])
    yield sp
    assert sp.stop() == 0, "\n".join(sp.log)


def test_vllm_flags_reach_the_engine(vllm_flags: ServeProcess):
    assert _engine(vllm_flags.url) == {
        "block_size": 32, "max_num_seqs": 6, "max_num_batched_tokens": 512, "gpu_memory_utilization": 0.5,
        "kv_cache_bytes": None, "enable_prefix_caching": False, "enforce_eager": True, "seed": 11,
        "tokenizer": GGUF,
    }  # fmt: skip
    h = {"Authorization": f"Bearer {KEY}"}
    models = httpx.get(f"{vllm_flags.url}/v1/models", headers=h, timeout=10).json()
    assert [m["id"] for m in models["data"]] == ["tiny", "tiny-alias"]  # as vLLM lists its names
    body = {"model": "tiny-alias", "prompt": "Hello", "max_tokens": 4}
    r = httpx.post(f"{vllm_flags.url}/v1/completions", json=body, headers=h, timeout=60)
    assert r.status_code == 200 and r.json()["model"] == "tiny", r.text
    assert httpx.post(f"{vllm_flags.url}/v1/completions", json=body, timeout=10).status_code == 401


def test_json_log_lines_and_worker_vllm_metrics(vllm_flags: ServeProcess):
    def access_lines() -> list[dict]:
        lines = [line for line in list(vllm_flags.log) if line.startswith("{")]
        return [json.loads(x) for x in lines if '"splitserve.access"' in x]

    # the server's lines reach this process through a pipe and a reader thread: wait for both statuses
    deadline = time.monotonic() + 20
    while not {a["status"] for a in access_lines()} >= {200, 401} and time.monotonic() < deadline:
        time.sleep(0.2)
    access = access_lines()
    assert access and {"ts", "level", "request_id", "route", "status", "latency_ms"} <= set(access[0])
    assert {a["status"] for a in access} >= {200, 401}
    for line in vllm_flags.log:  # stderr and stdout: JSON objects, but the one "serving" banner
        if line and not line.startswith("splitserve: serving"):
            assert isinstance(json.loads(line), dict), line
    (worker,) = vllm_flags.ready["workers"]
    assert httpx.get(f"{worker['url']}/metrics", timeout=10).status_code == 401  # the token, as /stats
    text = httpx.get(f"{worker['url']}/metrics", headers=worker_headers(SECRET), timeout=10).text
    s = _samples(text)
    labels = frozenset({"model_name": "tiny", "role": "colocated"}.items())
    for name in ("vllm:num_requests_waiting", "vllm:kv_cache_usage_perc", "vllm:num_requests_running",
                 "vllm:num_preemptions_total", "vllm:prefix_cache_queries_total"):  # fmt: skip
        assert (name, labels) in s, name
    spec_labels = frozenset({**dict(labels), "method": "ngram"}.items())
    for name in ("vllm:spec_decode_num_drafts_total", "vllm:spec_decode_num_draft_tokens_total",
                 "vllm:spec_decode_num_accepted_tokens_total"):  # fmt: skip
        assert (name, spec_labels) in s, name


def test_manifest_with_vllm_names_reaches_the_engine(vllm_manifest: ServeProcess):
    assert _engine(vllm_manifest.url) == {
        "block_size": 16, "max_num_seqs": 5, "max_num_batched_tokens": 256, "gpu_memory_utilization": 0.4,
        "kv_cache_bytes": None, "enable_prefix_caching": False, "enforce_eager": True, "seed": 3,
        "tokenizer": GGUF,
    }  # fmt: skip
    # metrics_auth: /metrics wants the key here (open by default, as vLLM's: tests/router/test_bad_input.py)
    assert httpx.get(f"{vllm_manifest.url}/metrics", timeout=10).status_code == 401
    h = {"Authorization": f"Bearer {KEY}"}
    assert (
        "vllm:num_requests_waiting" in httpx.get(f"{vllm_manifest.url}/metrics", headers=h, timeout=10).text
    )


async def _load(url: str, n: int) -> list[int]:
    h = {"Authorization": f"Bearer {KEY}"}
    async with httpx.AsyncClient(timeout=120) as c:

        async def one(i: int) -> int:
            body = {
                "model": "mani-2",
                "prompt": f"Count to {i}:",
                "max_tokens": 12,
                "ignore_eos": True,
                "stream": i % 2 == 0,
            }
            r = await c.post(f"{url}/v1/completions", json=body, headers=h)
            return r.status_code

        return list(await asyncio.gather(*(one(i) for i in range(n))))


def test_access_log_stats_line_and_a_4xx_burst(vllm_manifest: ServeProcess):
    url, log = vllm_manifest.url, vllm_manifest.log
    assert asyncio.run(_load(url, 12)) == [200] * 12
    before = {s: _errors(url, s) for s in ("400", "401", "404")}
    h = {"Authorization": f"Bearer {KEY}"}
    for _ in range(6):  # a burst: wrong key, unknown model, bad JSON
        httpx.post(f"{url}/v1/completions", json={"model": "mani", "prompt": "x"}, timeout=10)
        httpx.post(f"{url}/v1/completions", json={"model": "nope", "prompt": "x"}, headers=h, timeout=10)
        httpx.post(f"{url}/v1/completions", content=b"{not json", headers=h, timeout=10)
    assert {s: _errors(url, s) - before[s] for s in before} == {"400": 6, "401": 6, "404": 6}
    deadline = time.monotonic() + 15
    stats = re.compile(r"INFO splitserve\.stats: Avg prompt throughput: [\d.]+ tokens/s, Avg generation "
                       r"throughput: ([\d.]+) tokens/s, Running: \d+ reqs, Waiting: \d+ reqs, KV cache "
                       r"usage: [\d.]+%, Prefix cache hit rate: [\d.]+%")  # fmt: skip
    while time.monotonic() < deadline:
        lines = list(log)
        busy = [m for m in map(stats.search, lines) if m and float(m.group(1)) > 0]
        if busy:
            break
        time.sleep(0.5)
    assert busy, "no stats line with generation throughput:\n" + "\n".join(lines[-40:])
    access = [x for x in lines if "INFO splitserve.access: " in x]
    line = re.compile(
        r"cmpl-\w+ POST /v1/completions 200 prompt_tokens=\d+ completion_tokens=12 "
        r"latency_ms=[\d.]+ ttft_ms=[\d.]+"
    )
    ok = [x for x in access if line.search(x)]
    assert len(ok) == 12, "\n".join(access)
    for status in ("400", "401", "404"):
        assert sum(f"POST /v1/completions {status} " in x for x in access) == 6, status
    assert all(re.match(r"\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3} (INFO|WARNING|ERROR) ", x) for x in access)
