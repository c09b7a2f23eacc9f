"""`splitserve bench` end to end: argument errors, a target that does not answer, the report files; and
one slow run against a real colocated deployment."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

from splitserve.ab import report as rep
from splitserve.ab.verdict import VerdictConfig, decide, rules_text
from splitserve.cli import main

RATES = (0.5, 1.0, 2.0)
BASE = {
    "model": {"max_model_len": 2048},
    "engine": {"kv_cache_mb": 128, "max_num_seqs": 32},
    "server": {"port": 0},
    "runtime": {"health_interval_s": 0.5},
}


def _point(rate: float, good: int, ttft: float, kv: float | None) -> dict:
    stat = {
        "count": 10,
        "mean": ttft,
        "std": 1.0,
        "max": ttft * 2,
        "p50": ttft,
        "p90": ttft,
        "p95": ttft,
        "p99": ttft,
    }
    server = {"ttft_ms": ttft, "queue_ms": 1.0, "prefill_ms": ttft / 2, "first_decode_ms": ttft / 4}
    if kv is not None:
        server |= {"transfer_incl_wait_ms": ttft / 4, "kv_share_of_ttft": kv, "kv": {}}
    return {
        "rate": rate,
        "metrics": {
            "requests": 10, "completed": 10, "failed": 0, "failures": {}, "duration_s": 10.0, "good": good,
            "goodput_rps": good / 10, "slo_attainment": good / 10, "request_throughput": 1.0,
            "output_throughput": 40.0, "ttft_ms": stat, "tpot_ms": stat, "itl_ms": stat, "e2el_ms": stat,
        },
        "server": server,
        "util": {"cpu_host_pct": 90.0, "cpu_deployment_cores": 1.5, "gpu_util_pct": None},
        "cost_per_accepted_usd": 0.1 * 10 / 3600 / good if good else float("inf"),
    }  # fmt: skip


def _target(name: str, goods: list[int], kv: float | None) -> dict:
    points = [_point(r, g, 100.0 * (i + 1), kv) for i, (r, g) in enumerate(zip(RATES, goods, strict=True))]
    return {
        "name": name, "source": f"{name}.yaml", "mode": name, "model": "m", "error": None,
        "hardware": {"devices": {"cpu": 2}, "usd_per_hour": 0.1, "formula": "2 x cpu at $0.05/h = $0.1/h"},
        "points": points,
    }  # fmt: skip


def test_report_files(tmp_path):
    pytest.importorskip("matplotlib")
    targets = [_target("colocated", [10, 8, 2], None), _target("disaggregated", [10, 10, 9], 0.05)]
    cfg = VerdictConfig()
    report = {
        "created": "now", "command": "splitserve bench a b", "slo": "TTFT <= 2000 ms",
        "workload": {"description": "synthetic"}, "gate": {"status": "gate not run", "detail": "not built"},
        "config": {"slo": {"ttft_ms": 2000, "tpot_ms": 200}, "attainment_target": 0.9, "seed": 0},
        "targets": targets, "verdicts": [decide(targets[1], targets[0], cfg).to_json()],
        "rules": rules_text(cfg),
    }  # fmt: skip
    plots = rep.write_plots(tmp_path, report)
    assert plots == ["goodput.png", "latency.png", "ttft_breakdown.png", "cost.png"]
    assert all((tmp_path / p).read_bytes()[:4] == b"\x89PNG" for p in plots)
    rep.write_json(tmp_path, report)
    page = rep.write_html(tmp_path, report, plots).read_text()
    for word in ("gate not run", "R1 trial", "TRIAL", "goodput.png", "cost per accepted response"):
        assert word in page
    back = json.loads((tmp_path / "report.json").read_text())
    assert back["targets"][1]["points"][0]["metrics"]["good"] == 10
    assert back["targets"][0]["points"][0]["server"].get("kv_share_of_ttft") is None
    summary = rep.text_summary(report)
    assert "verdict disaggregated vs colocated: TRIAL" in summary
    assert rep.markdown_table(rep.summary_rows(report)).startswith("| target | rate |")


@pytest.mark.parametrize(
    "extra, word",
    [
        (["--input-len", "gauss:3"], "length spec"),
        (["--request-rates", "0"], "positive"),
        (["--turns", "5:2"], "--turns"),
        (["--usd-per-hour", "cpu"], "KEY=VALUE"),
        (["--workload", "replay"], "--trace"),
        (["--client-procs", "0"], "--client-procs"),
    ],
)
def test_bad_arguments_exit_2(tmp_path, capsys, extra, word):
    assert main(["bench", "http://127.0.0.1:1", "--out", str(tmp_path), *extra]) == 2
    assert word in capsys.readouterr().err


def test_a_target_failing_the_verify_gate_is_not_benchmarked(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPLITSERVE_KV_SECRET", "ab-test-secret-0123456789abcdef")
    out = tmp_path / "r"
    assert main(["bench", "down=http://127.0.0.1:1", "--verify", "--out", str(out), "--no-progress"]) == 1
    assert "verify gate failed" in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["gate"]["status"] == "failed" and report["targets"][0]["points"] == []


def test_the_verify_gate_without_the_kv_secret_says_how_to_give_it(tmp_path, capsys, monkeypatch):
    monkeypatch.delenv("SPLITSERVE_KV_SECRET", raising=False)
    out = tmp_path / "r"
    assert main(["bench", "down=http://127.0.0.1:1", "--verify", "--out", str(out), "--no-progress"]) == 1
    err = capsys.readouterr().err
    assert "KV secret" in err and "--skip-verify" in err


def test_an_unreachable_target_fails_the_run(tmp_path, capsys):
    out = tmp_path / "r"
    code = main(
        [
            "bench",
            "down=http://127.0.0.1:1",
            "--model",
            "m",
            "--skip-verify",
            "--out",
            str(out),
            "--no-progress",
        ]
    )
    assert code == 1
    assert "down failed" in capsys.readouterr().err
    report = json.loads((out / "report.json").read_text())
    assert report["targets"][0]["error"] and report["gate"]["status"] == "gate not run"


@pytest.mark.slow
def test_bench_a_colocated_deployment(tmp_path, capsys):
    manifest = tmp_path / "colocated.yaml"
    manifest.write_text(
        yaml.safe_dump({**BASE, "mode": "colocated", "slos": {"ttft_ms": 60000, "itl_ms": 5000}})
    )
    out = tmp_path / "report"
    code = main(
        ["bench", f"colo={manifest}", "--num-prompts", "6", "--request-rates", "4",
         "--input-len", "uniform:16:48", "--output-len", "fixed:6", "--warmup", "1", "--out", str(out),
         "--no-progress"]
    )  # fmt: skip
    text = capsys.readouterr().out
    assert code == 0, text
    report = json.loads((out / "report.json").read_text())
    (t,) = report["targets"]
    assert t["error"] is None and t["mode"] == "colocated" and t["hardware"]["devices"] == {"cpu": 1}
    m = t["points"][0]["metrics"]
    assert m["completed"] == 6 and m["total_output_tokens"] == 36  # ignore_eos: exactly 6 each
    assert m["good"] == 6 and m["ttft_ms"]["p50"] > 0 and m["tpot_ms"]["count"] == 6
    server = t["points"][0]["server"]
    assert server["generation_tokens"] == 36  # the router's /metrics agree with the client's usage
    assert 0 < server["ttft_ms"] <= m["ttft_ms"]["max"] * 1.05
    assert (out / "report.html").exists() and len(list((out / "requests").glob("*.jsonl"))) == 1
    assert "colo" in text and "gate (splitserve verify): passed" in text  # the gate runs first by default
    assert report["gate"]["status"] == "passed"
    assert Path(out / "trace-0.jsonl").read_text().count("\n") == 6
