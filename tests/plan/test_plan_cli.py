"""`splitserve plan` end to end on a saved profile: the table of every deployment a budget allows,
the choice, and a manifest that the manifest parser loads and that deploys the choice."""

from __future__ import annotations

import pytest

from splitserve.cli import main
from splitserve.config.manifest import load_manifest
from splitserve.plan.cost import StepCost
from splitserve.plan.profile import FitReport, Profile

# prompts are slow (1 ms a token), decode rows cheap (10 ms a step + 2 ms a request)
COST = StepCost(
    base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002,
    latency_s=0.001, bytes_per_s=1e9, kv_bytes_per_token=46080,
)  # fmt: skip


@pytest.fixture
def profile_path(tmp_path):
    fit = FitReport(1, 0.0, 0.0, "-")
    profile = Profile(
        model="default", device="cpu", dtype="float32", threads=1, backend="shm", block_size=16,
        max_num_batched_tokens=2048, max_num_seqs=64, cost=COST, step_fit=fit, transfer_fit=fit,
    )  # fmt: skip
    path = tmp_path / "profile.json"
    profile.save(path)
    return path


def _plan(tmp_path, profile_path, *extra: str) -> int:
    return main(["plan", "--profile", str(profile_path), "--out", str(tmp_path / "plan.yaml"), *extra])


def test_plan_prints_every_split_and_writes_a_manifest_that_deploys_the_best(tmp_path, profile_path, capsys):
    # 1000-token prompts at 1.5 req/s: a colocated replica's decoders stall behind 1 s prefill steps
    # (TPOT over 15 ms); two prefill workers keep up and one decode worker holds every decoder
    rc = _plan(
        tmp_path, profile_path, "--devices", "3", "--request-rate", "1.5", "--num-prompts", "60",
        "--input-len", "fixed:1000", "--output-len", "fixed:50", "--slo-ttft-ms", "5000",
        "--slo-tpot-ms", "15", "--price-per-device-hour", "2.0",
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    rows = [line[:12].strip() for line in out.splitlines() if line.startswith(("colocated x", "1P:", "2P:"))]
    assert rows == ["colocated x1", "colocated x2", "colocated x3", "1P:1D", "1P:2D", "2P:1D"]
    assert "best: 2P:1D (3 devices)" in out and "cheaper per accepted response than the runner-up" in out
    manifest = load_manifest(tmp_path / "plan.yaml")
    assert manifest.mode == "disaggregated"
    assert (manifest.prefill.replicas, manifest.decode.replicas) == (2, 1)
    assert manifest.slos.ttft_ms == 5000 and manifest.slos.itl_ms == 15
    assert manifest.prices.usd_per_hour["cpu"] == 2.0
    assert (tmp_path / "plan.yaml").read_text().startswith("# splitserve plan for synthetic, 60 requests")


def test_a_light_trace_stays_colocated_on_one_device(tmp_path, profile_path, capsys):
    rc = _plan(tmp_path, profile_path, "--devices", "2", "--request-rate", "0.2", "--num-prompts", "20",
               "--input-len", "fixed:100", "--output-len", "fixed:8")  # fmt: skip
    assert rc == 0
    assert "best: colocated x1 (1 device)" in capsys.readouterr().out
    manifest = load_manifest(tmp_path / "plan.yaml")
    assert manifest.mode == "colocated" and manifest.colocated.replicas == 1


@pytest.mark.parametrize(
    "args, message",
    [
        (["--devices", "0"], "--devices must be at least 1"),
        (["--input-len", "fixed:0"], "bad length spec"),
        (["--num-prompts", "0"], "--num-prompts must be at least 1"),
    ],
)
def test_bad_arguments_exit_2_naming_the_flag(tmp_path, profile_path, capsys, args, message):
    assert _plan(tmp_path, profile_path, *args) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "plan.yaml").exists()


def test_a_file_that_is_not_a_profile_is_refused(tmp_path, capsys):
    bad = tmp_path / "bad.json"
    bad.write_text("[]")
    assert main(["plan", "--profile", str(bad), "--out", str(tmp_path / "p.yaml")]) == 2
    assert "not a splitserve profile" in capsys.readouterr().err
