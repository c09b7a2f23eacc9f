"""A real Prometheus (Debian's `prometheus` package) scrapes only the router's /metrics, without the API
key, as a scrape job copied from a vLLM deployment does; after a load, every query of a vLLM-style
dashboard (TTFT / TPOT percentiles, running and waiting, KV usage, prefix-cache hit rate, preemptions,
tokens/s) and a KEDA-style scaling query on `vllm:num_requests_waiting` returns data."""

from __future__ import annotations

import asyncio
import shutil
import socket
import subprocess
import time

import httpx
import pytest
import yaml
from serve_harness import MODEL

PROMETHEUS = shutil.which("prometheus")
M = f'model_name="{MODEL}"'


def _quantile(q: float, histogram: str) -> str:
    return f"histogram_quantile({q}, sum by (le) (rate({histogram}_bucket{{{M}}}[30s])))"


QUERIES = {
    "ttft p99": _quantile(0.99, "vllm:time_to_first_token_seconds"),
    "tpot p50": _quantile(0.5, "vllm:time_per_output_token_seconds"),
    "itl p90": _quantile(0.9, "vllm:inter_token_latency_seconds"),
    "e2e p95": _quantile(0.95, "vllm:e2e_request_latency_seconds"),
    "prefill p50": _quantile(0.5, "vllm:request_prefill_time_seconds"),
    "tokens per step p50": _quantile(0.5, "vllm:iteration_tokens_total"),
    "queue avg": f"rate(vllm:request_queue_time_seconds_sum{{{M}}}[30s]) "
    f"/ rate(vllm:request_queue_time_seconds_count{{{M}}}[30s])",
    "running": f"sum(vllm:num_requests_running{{{M}}})",
    "waiting": f"sum(vllm:num_requests_waiting{{{M}}})",
    "kv usage": f"max(vllm:kv_cache_usage_perc{{{M}}})",
    "prefix hit rate": f"sum(rate(vllm:prefix_cache_hits_total{{{M}}}[30s])) "
    f"/ sum(rate(vllm:prefix_cache_queries_total{{{M}}}[30s]))",
    "preemptions": f"sum(rate(vllm:num_preemptions_total{{{M}}}[30s]))",
    "prompt tok/s": f"sum(rate(vllm:prompt_tokens_total{{{M}}}[30s]))",
    "generation tok/s": f"sum(rate(vllm:generation_tokens_total{{{M}}}[30s]))",
    "finished by reason": f"sum by (finished_reason) (increase(vllm:request_success_total{{{M}}}[30s]))",
    "keda waiting": f"sum(max_over_time(vllm:num_requests_waiting{{{M}}}[1m]))",
    # disaggregated: the KV transfer of every request, under NIXL's names (whatever the backend)
    "kv transfer p90": _quantile(0.9, "vllm:nixl_xfer_time_seconds"),
    "kv bytes/s": f"sum(rate(vllm:nixl_bytes_transferred_sum{{{M}}}[30s]))",
}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.skipif(PROMETHEUS is None, reason="prometheus not installed (apt-get install prometheus)")
def test_a_vllm_dashboard_and_a_keda_query_find_their_series(disaggregated, tmp_path):
    port = _free_port()
    target = disaggregated.url.removeprefix("http://")
    config = {
        "global": {"scrape_interval": "1s"},
        "scrape_configs": [{"job_name": "vllm", "static_configs": [{"targets": [target]}]}],  # no key
    }
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    args = [PROMETHEUS, f"--config.file={tmp_path / 'prometheus.yml'}",
            f"--storage.tsdb.path={tmp_path / 'data'}", f"--web.listen-address=127.0.0.1:{port}",
            "--log.level=warn"]  # fmt: skip
    prom = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        asyncio.run(_load(disaggregated, seconds=8.0))
        deadline = time.monotonic() + 15  # the last scrapes after the load (one a second)
        while (missing := _missing(port)) and time.monotonic() < deadline:
            time.sleep(0.25)
        assert not missing, missing
        up = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": "up"}, timeout=10).json()
        assert [x["value"][1] for x in up["data"]["result"]] == ["1"]  # the one target, scraped without a key
    finally:
        prom.terminate()
        prom.wait(timeout=30)


def _missing(port: int) -> dict[str, dict]:
    """The dashboard's queries that return no data yet, with Prometheus' answers."""
    missing = {}
    for title, query in QUERIES.items():
        r = httpx.get(f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=10).json()
        if r["status"] != "success" or not r["data"]["result"]:
            missing[title] = r
    return missing


async def _load(dep, seconds: float) -> None:
    """Four clients send short chat requests (a shared prefix, so the prefix cache sees hits)."""
    client = dep.async_client()
    stop = time.monotonic() + seconds

    async def one(i: int) -> None:
        while time.monotonic() < stop:
            await client.chat.completions.create(
                model=MODEL, max_tokens=8, temperature=0,
                messages=[{"role": "user", "content": f"List three colours of the sea. Reply {i}."}],
            )  # fmt: skip

    await asyncio.gather(*(one(i) for i in range(4)))
    await client.close()
