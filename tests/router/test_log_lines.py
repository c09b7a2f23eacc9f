"""Log lines (text and JSON, a worker's line forwarded as JSON) and a worker's vLLM-named /metrics text,
without processes."""

from __future__ import annotations

import json
import logging

from prometheus_client.parser import text_string_to_metric_families

from splitserve.logs import TEXT_FORMAT, JsonFormatter, worker_line
from splitserve.wire.stats import (
    BlockCounts,
    IterationTokens,
    PrefixCacheCounts,
    SlotCounts,
    StepCounts,
    ThreadCounts,
    WorkerStats,
)
from splitserve.worker.metrics import render_worker_metrics


def _record(**extra) -> logging.LogRecord:
    rec = logging.LogRecord("splitserve.access", logging.INFO, __file__, 1, "%s done", ("cmpl-1",), None)
    rec.__dict__.update(extra)
    return rec


def test_json_lines_carry_time_level_and_the_extra_fields():
    line = json.loads(JsonFormatter().format(_record(status=404, route="/v1/completions")))
    assert line["level"] == "INFO" and line["logger"] == "splitserve.access" and line["msg"] == "cmpl-1 done"
    assert line["ts"].endswith("Z") and line["status"] == 404 and line["route"] == "/v1/completions"


def test_text_lines_carry_time_and_level():
    text = logging.Formatter(TEXT_FORMAT).format(_record())
    assert text.split(" ")[2:4] == ["INFO", "splitserve.access:"], text


def test_a_workers_json_line_stays_json_and_a_text_line_gets_its_name():
    assert json.loads(worker_line("decode-0", '{"level": "WARNING", "msg": "x"}')) == {
        "level": "WARNING", "msg": "x", "worker": "decode-0",
    }  # fmt: skip
    text = "2026-12-02 01:00:00,000 INFO x: y"
    assert worker_line("decode-0", text) == f"[decode-0] {text}"


def test_worker_metrics_are_what_an_inference_gateway_scrapes():
    stats = WorkerStats(
        role="decode", running=3, waiting=2, importing=0, unfinished=5, blocks=BlockCounts(100, 75, 0),
        state_slots=SlotCounts(4, 4), preemptions=4, iteration_tokens=IterationTokens([0] * 14, 0),
        block_size=16, prompt_tokens_computed=0, kv_bytes_per_token=1,
        steps=StepCounts(0, 0, 0.0, 0.0), threads=ThreadCounts(1, 1, 0, 0),
        prefix_cache=PrefixCacheCounts(True, 90, 30, None), kv_transfer=None, memory=None, spec_decode=None,
    )  # fmt: skip
    text = render_worker_metrics(stats, "smol", 16).decode()
    got = {s.name: s for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert got["vllm:num_requests_waiting"].value == 2 and got["vllm:num_requests_running"].value == 3
    assert got["vllm:kv_cache_usage_perc"].value == 0.25 == got["vllm:gpu_cache_usage_perc"].value
    assert got["vllm:num_preemptions_total"].value == 4
    assert got["vllm:prefix_cache_queries_total"].value == 90
    assert got["vllm:prefix_cache_hits_total"].value == 30
    assert got["vllm:num_requests_waiting"].labels == {"model_name": "smol", "role": "decode"}
    assert got["vllm:cache_config_info"].labels["block_size"] == "16"
