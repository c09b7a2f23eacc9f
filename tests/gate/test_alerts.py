"""The shipped alert rules and dashboard: well-formed, valid PromQL, and only metrics the router exports.
With `promtool` installed (Debian's `prometheus` package; .ci/run installs it), the rules are also
checked by Prometheus itself (`promtool check rules`) and its rule engine runs their unit tests
(`promtool test rules deploy/prometheus/alerts_test.yaml`: each alert fires on the first event of its
kind). Without it, a PromQL parser and a schema of the rule-file format check them. The router's
counters are there at 0 before their first event (what those unit tests assume).
bench/prometheus_alerts.py runs a real Prometheus against a real deployment."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml
from worker_rows import worker_row

from splitserve.router.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
RULE_TESTS = ROOT / "deploy" / "prometheus" / "alerts_test.yaml"
PROMTOOL = shutil.which("promtool")
DASHBOARD = ROOT / "deploy" / "grafana" / "splitserve-dashboard.json"
NAME = re.compile(r"splitserve:[a-zA-Z_]+")


def _exported() -> set[str]:
    names = set()
    for metric in RouterMetrics("m").registry.collect():
        names.add(metric.name)
        for sample in metric.samples:
            names.add(sample.name)
        if metric.type == "counter":
            names |= {f"{metric.name}_total", f"{metric.name}_created"}
        if metric.type == "histogram":
            names |= {f"{metric.name}_bucket", f"{metric.name}_sum", f"{metric.name}_count"}
    return names


def _check_promql(expr: str) -> None:
    promql_parser = pytest.importorskip("promql_parser")
    promql_parser.parse(expr)  # raises on a syntax error
    unknown = set(NAME.findall(expr)) - _exported()
    assert not unknown, f"{expr}: not exported by the router: {unknown}"


def test_alert_rules_are_valid():
    doc = yaml.safe_load(RULES.read_text())
    assert set(doc) == {"groups"}
    seen = set()
    for group in doc["groups"]:
        assert set(group) <= {"name", "interval", "rules"} and group["name"] and group["rules"]
        for rule in group["rules"]:
            assert set(rule) <= {"alert", "expr", "for", "labels", "annotations", "keep_firing_for"}, rule
            assert re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", rule["alert"]) and rule["alert"] not in seen
            seen.add(rule["alert"])
            if "for" in rule:
                assert re.fullmatch(r"\d+[smhd]", rule["for"])
            assert rule["labels"]["severity"] in ("warning", "critical")
            assert rule["annotations"]["summary"]
            _check_promql(rule["expr"])
    assert {
        "SplitserveKVBackendNotRequired",
        "SplitserveKVBandwidthLow",
        "SplitserveKVTransferFailures",
        "SplitserveWorkerRestarted",
        "SplitserveDecodeRecomputesPrompts",
        "SplitservePrefillPoolIdle",
        "SplitserveKVBytesPerTokenLow",
    } <= seen


def test_a_broken_expression_would_be_caught():
    promql_parser = pytest.importorskip("promql_parser")
    with pytest.raises(Exception):  # noqa: B017 - the parser's own error type
        promql_parser.parse("sum(rate(splitserve:kv_transfer_seconds_sum[5m])")
    with pytest.raises(AssertionError):
        _check_promql("splitserve:no_such_metric > 0")


def test_dashboard_loads_and_queries_exported_metrics():
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] == "splitserve" and dash["schemaVersion"] >= 30
    assert dash["annotations"]["list"][0]["builtIn"] == 1  # grafana-foundation-sdk's schema wants the key
    titles = [p["title"] for p in dash["panels"]]
    for want in (
        "Time to first token",
        "Inter-token latency",
        "KV transfer time by backend",
        "KV transfer share of TTFT",
        "KV backend per worker (actually instantiated)",
    ):
        assert want in titles
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for panel in dash["panels"]:
        assert panel["targets"]
        for target in panel["targets"]:
            _check_promql(target["expr"].replace("$model", ".*"))


@pytest.mark.skipif(PROMTOOL is None, reason="promtool not installed (apt-get install prometheus)")
def test_promtool_checks_the_rules_and_runs_their_unit_tests():
    for args in (["check", "rules", str(RULES)], ["test", "rules", str(RULE_TESTS)]):
        out = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stdout + out.stderr
        assert "SUCCESS" in out.stdout


def test_every_alerted_counter_is_there_at_zero_before_its_first_event():
    """`increase()` needs a sample before the first event: the router creates each labelled counter at
    0 for the labels it will carry (alerts_test.yaml's last test shows the alert missing it otherwise)."""
    m = RouterMetrics("m")
    m.prime("tcp")
    m.prime_workers([{"name": "prefill-0", "role": "prefill"}, {"name": "decode-0", "role": "decode"}])
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for metric in m.registry.collect()
        for s in metric.samples
    }
    want = [
        ("splitserve:worker_restarts_total", {"worker": "decode-0", "role": "decode"}),
        ("splitserve:worker_restarts_total", {"worker": "prefill-0", "role": "prefill"}),
        ("splitserve:kv_probe_failures_total", {"prefill": "prefill-0", "decode": "decode-0"}),
        ("splitserve:kv_transfer_failures_total", {"backend": "tcp", "kind": "kv_transfer_failed"}),
        ("splitserve:kv_transfer_failures_total", {"backend": "tcp", "kind": "kv_transfer_timeout"}),
        ("splitserve:request_errors_total", {"status": "429"}),
        ("splitserve:request_errors_total", {"status": "400"}),
        ("splitserve:request_errors_total", {"status": "401"}),
        ("splitserve:num_preemptions_total", {"worker": "decode-0", "role": "decode"}),
        ("splitserve:prefix_cache_hits_total", {"worker": "decode-0", "role": "decode"}),
        ("splitserve:kv_recomputed_tokens_total", {"worker": "decode-0", "role": "decode"}),
        ("splitserve:prompt_tokens_computed_total", {"worker": "prefill-0", "role": "prefill"}),
        ("splitserve:kv_imported_tokens_total", {"worker": "decode-0", "role": "decode"}),
        ("splitserve:kv_fetched_bytes_total", {"worker": "decode-0", "role": "decode"}),
    ]
    for name, labels in want:
        key = (name, tuple(sorted({"model_name": "m", **labels}.items())))
        assert samples.get(key) == 0.0, (name, labels)


def test_worker_counters_follow_the_workers_totals_across_a_restart():
    m = RouterMetrics("m")
    row = {"preemptions": 3, "prefix_cache": {"queries": 40, "hits": 16}}
    m.from_worker_stats([worker_row("decode-0", "decode", **row)], ["tcp"])
    m.from_worker_stats([worker_row("decode-0", "decode", **{**row, "preemptions": 5})], ["tcp"])
    restarted = {"preemptions": 1, "prefix_cache": {"queries": 8, "hits": 0}}
    m.from_worker_stats([worker_row("decode-0", "decode", **restarted)], ["tcp"])
    value = m.registry.get_sample_value
    lab = {"model_name": "m", "worker": "decode-0", "role": "decode"}
    assert value("splitserve:num_preemptions_total", lab) == 6
    assert value("splitserve:prefix_cache_queries_total", lab) == 48
    assert value("splitserve:prefix_cache_hits_total", lab) == 16
