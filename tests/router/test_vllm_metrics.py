"""vLLM's metric names on the router's registry (router/vllm_metrics.py, vllm_workers.py): request figures
as a request finishes, the KV transfer before its first token, every worker's scheduler, cache and
speculative-decoding figures from its /stats, counters monotonic across a restart."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.utils import floatToGoString
from worker_rows import worker_row

from splitserve.router.vllm_metrics import RunFigures, VllmMetrics, buckets_1_2_5
from splitserve.wire.stats import WorkerRow

LAB = {"model_name": "m"}


def _row(worker: str, role: str, **kw) -> WorkerRow:
    row = {"running": 2, "waiting": 1, "blocks": {"total": 10, "free": 4},
           "preemptions": 3, "prefix_cache": {"queries": 40, "hits": 16},
           "iteration_tokens": {"counts": [0, 2, 0, 1] + [0] * 10, "sum": 30}, "block_size": 16,
           "spec_decode": {"method": "ngram", "num_drafts": 4, "num_draft_tokens": 12,
                           "num_accepted_tokens": 7, "accepted_per_pos": [4, 2, 1]}}  # fmt: skip
    return worker_row(worker, role, **{**row, **kw})


def test_buckets_follow_vllms_1_2_5_series():
    assert buckets_1_2_5(2048) == (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000)
    assert buckets_1_2_5(1) == (1,)


def test_a_finished_request_fills_the_request_histograms():
    reg = CollectorRegistry()
    v = VllmMetrics(reg, "m", 2048)
    v.observe_first(0.2, {"queue_s": 0.05, "prefill_s": 0.1})
    v.itl_bound.observe(0.03)
    v.observe_done(RunFigures(e2e=1.2, ttft=0.2, queue_s=0.05, prefill_s=0.1, prompt_tokens=12,
                              output_tokens=11, max_choice_tokens=11, n=1, max_tokens=64))  # fmt: skip
    value = reg.get_sample_value
    assert value("vllm:time_to_first_token_seconds_count", LAB) == 1
    assert value("vllm:e2e_request_latency_seconds_sum", LAB) == 1.2
    assert value("vllm:request_queue_time_seconds_sum", LAB) == 0.05
    assert value("vllm:request_prefill_time_seconds_sum", LAB) == 0.1
    assert abs(value("vllm:request_decode_time_seconds_sum", LAB) - 1.0) < 1e-9
    assert abs(value("vllm:request_inference_time_seconds_sum", LAB) - 1.1) < 1e-9
    assert abs(value("vllm:request_time_per_output_token_seconds_sum", LAB) - 0.1) < 1e-9
    assert value("vllm:prompt_tokens_total", LAB) == 12
    assert value("vllm:request_prompt_tokens_bucket", {**LAB, "le": "20.0"}) == 1
    assert value("vllm:request_prompt_tokens_bucket", {**LAB, "le": "10.0"}) == 0
    assert value("vllm:request_generation_tokens_sum", LAB) == 11
    assert value("vllm:request_params_n_bucket", {**LAB, "le": "1.0"}) == 1
    assert value("vllm:request_params_max_tokens_sum", LAB) == 64
    # the older TPOT name is the inter-token latency, rendered as a copy
    assert value("vllm:time_per_output_token_seconds_count", LAB) == 1
    assert value("vllm:time_per_output_token_seconds_bucket", {**LAB, "le": "0.05"}) == 1
    for reason in ("stop", "length", "abort"):  # there at 0 before the first
        assert value("vllm:request_success_total", {**LAB, "finished_reason": reason}) == 0


def test_every_worker_is_a_series_and_counters_survive_a_restart():
    reg = CollectorRegistry()
    v = VllmMetrics(reg, "m", 2048)
    v.from_worker_stats([_row("prefill-0", "prefill"), _row("decode-0", "decode")], router_waiting=3)
    v.from_worker_stats([_row("prefill-0", "prefill", preemptions=5), _row("decode-0", "decode")], 0)
    restarted = _row("prefill-0", "prefill", preemptions=1, iteration_tokens={"counts": [1] + [0] * 13,
                                                                              "sum": 1})  # fmt: skip
    v.from_worker_stats([restarted, worker_row("decode-1", "decode", up=False)], 0)
    value = reg.get_sample_value
    p = {**LAB, "worker": "prefill-0", "role": "prefill"}
    assert value("vllm:num_requests_running", p) == 2
    assert value("vllm:num_requests_waiting", p) == 1
    assert value("vllm:num_requests_waiting", {**LAB, "worker": "router", "role": "router"}) == 0
    assert abs(value("vllm:kv_cache_usage_perc", p) - 0.6) < 1e-9
    assert value("vllm:num_preemptions_total", p) == 6
    assert value("vllm:prefix_cache_queries_total", p) == 80
    assert value("vllm:prefix_cache_hits_total", p) == 32
    assert value("vllm:iteration_tokens_total_count", p) == 4
    assert value("vllm:iteration_tokens_total_sum", p) == 31
    assert value("vllm:iteration_tokens_total_bucket", {**p, "le": "1.0"}) == 1
    assert value("vllm:iteration_tokens_total_bucket", {**p, "le": "8.0"}) == 3
    assert value("vllm:iteration_tokens_total_bucket", {**p, "le": "+Inf"}) == 4
    assert value("vllm:num_requests_running", {**LAB, "worker": "decode-1", "role": "decode"}) is None
    # speculative decoding: three snapshots of the same totals, the last after a restart
    assert value("vllm:spec_decode_num_drafts_total", p) == 8
    assert value("vllm:spec_decode_num_accepted_tokens_total", p) == 14
    assert value("vllm:spec_decode_num_accepted_tokens_per_pos_total", {**p, "position": "2"}) == 2
    info = {**p, "block_size": "16", "num_gpu_blocks": "10", "enable_prefix_caching": "True"}
    assert value("vllm:cache_config_info", info) == 1
    text = generate_latest(reg).decode()
    assert "# TYPE vllm:iteration_tokens_total histogram" in text


def test_a_kv_transfer_is_observed_under_nixls_names():
    reg = CollectorRegistry()
    v = VllmMetrics(reg, "m", 2048, backend="nixl")
    lab = {**LAB, "backend": "nixl"}
    assert reg.get_sample_value("vllm:nixl_num_failed_transfers_total", lab) == 0  # there from the start
    v.observe_first(0.3, {"kv_backend": "nixl", "kv_fetch_s": 0.02, "kv_bytes": 3 << 20})
    v.observe_first(0.4, {"kv_backend": "nixl", "kv_fetch_s": 0.5, "kv_error": "timeout"})  # recomputed
    v.observe_first(0.1, {"queue_s": 0.01})  # colocated: no transfer
    value = reg.get_sample_value
    assert value("vllm:nixl_xfer_time_seconds_count", lab) == 1
    assert value("vllm:nixl_xfer_time_seconds_bucket", {**lab, "le": "0.025"}) == 1
    assert value("vllm:nixl_bytes_transferred_sum", lab) == 3 << 20
    assert value("vllm:nixl_bytes_transferred_bucket", {**lab, "le": floatToGoString(2**21)}) == 0
    assert value("vllm:nixl_bytes_transferred_bucket", {**lab, "le": floatToGoString(2**23)}) == 1
    assert value("vllm:nixl_num_failed_transfers_total", lab) == 1
    assert value("vllm:time_to_first_token_seconds_count", LAB) == 3
