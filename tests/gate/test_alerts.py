"""The shipped alert rules and dashboard: well-formed, valid PromQL, and only metrics the router exports.
(`promtool` cannot be installed here, so the rules are checked with a PromQL parser and a schema of the
rule-file format instead.)"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml

from splitserve.serve.metrics import RouterMetrics

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "deploy" / "prometheus" / "alerts.yaml"
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
