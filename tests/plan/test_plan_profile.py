"""Profiles: the fit recovers a known step-time model, keeps coefficients non-negative, survives a
save and load; and a short profiling run on the real engine and the real shm transport times the
shapes its grid asks for."""

from __future__ import annotations

import math

import msgspec
import numpy as np
import pytest

from splitserve.plan.cost import StepCost, StepShape, chunk_pairs
from splitserve.plan.profile import (
    Profile,
    StepPoint,
    TransferPoint,
    fit_transfers,
    fitted_cost,
    nonneg_relative_fit,
    pooled,
)

TRUE = StepCost(
    base_s=0.02, prefill_token_s=0.002, prefill_pair_s=8e-7, decode_seq_s=0.0013, decode_context_s=3e-6
)


def _points(cost: StepCost) -> list[StepPoint]:
    shapes = [StepShape(n, chunk_pairs(s, n)) for n, s in ((64, 0), (256, 0), (512, 0), (384, 384))]
    shapes += [StepShape(decode_seqs=b, decode_context=b * c) for b in (1, 8, 16) for c in (64, 512)]
    shapes += [StepShape(100, chunk_pairs(0, 100), 4, 4 * 300)]
    return [
        StepPoint(s.prefill_tokens, s.prefill_pairs, s.decode_seqs, s.decode_context, cost.step_s(s))
        for s in shapes
    ]


def test_the_fit_recovers_a_known_step_model_and_handoff():
    transfers = [TransferPoint(b, 2e-4 + b / 8e9) for b in (1 << 20, 4 << 20, 16 << 20, 64 << 20)]
    cost, step_fit, transfer_fit = fitted_cost(_points(TRUE), transfers, 46080, 0)
    for name in ("base_s", "prefill_token_s", "prefill_pair_s", "decode_seq_s", "decode_context_s"):
        assert getattr(cost, name) == pytest.approx(getattr(TRUE, name), rel=1e-6), name
    assert cost.latency_s == pytest.approx(2e-4) and cost.bytes_per_s == pytest.approx(8e9)
    assert step_fit.rms_rel < 1e-9 and transfer_fit.max_rel < 1e-9
    assert cost.transfer_s(1000) == pytest.approx(2e-4 + 46080 * 1000 / 8e9)


def test_coefficients_stay_non_negative():
    # y falls with the second feature: unconstrained least squares would give it a negative cost
    x = np.array([[1.0, 0.0], [1.0, 1.0], [1.0, 2.0]])
    y = np.array([1.0, 0.9, 0.8])
    coef = nonneg_relative_fit(x, y)
    assert coef[1] == 0.0 and coef[0] > 0
    latency, bandwidth, _ = fit_transfers([TransferPoint(10, 1.0), TransferPoint(20, 1.0)])
    assert latency == pytest.approx(1.0) and math.isinf(bandwidth)


def test_a_profile_survives_save_and_load(tmp_path):
    cost, step_fit, transfer_fit = fitted_cost(
        _points(TRUE), [TransferPoint(1 << 20, 1e-3), TransferPoint(2 << 20, 2e-3)], 100, 5
    )
    profile = Profile(
        model="m", device="cpu", dtype="float32", threads=1, backend="shm", block_size=16,
        max_num_batched_tokens=2048, max_num_seqs=64, cost=cost, step_fit=step_fit,
        transfer_fit=transfer_fit, steps=_points(TRUE),
    )  # fmt: skip
    path = tmp_path / "p.json"
    profile.save(path)
    again = Profile.load(path)
    assert again == profile
    assert "fit over 11 steps" in again.describe()
    path.write_text('{"version": 1}')
    with pytest.raises(ValueError, match="not a splitserve profile"):
        Profile.load(path)


def test_profiling_the_real_engine_times_the_grid_it_asks_for():
    from splitserve.config.engine import EngineConfig
    from splitserve.plan.measure import Grid, profile_engine

    grid = Grid(
        prefill_lens=(32, 128), chunked_len=200, chunk_budget=64, decode_shapes=((1, 32), (4, 32)),
        decode_steps=3, transfer_blocks=(1, 4), transfer_reps=2,
    )  # fmt: skip
    config = EngineConfig(
        progress=False, kv_cache_bytes=64 << 20, max_model_len=512, max_num_batched_tokens=512
    )
    profile = profile_engine(config, "shm", threads=1, grid=grid, log=lambda *_: None)
    prefill = [p for p in profile.steps if p.decode_seqs == 0]
    # one step per short prompt, ceil(200 / 64) = 4 chunks for the long one, then the decode batches' prefills
    assert [p.prefill_tokens for p in prefill[:6]] == [32, 128, 64, 64, 64, 8]
    assert [p.prefill_pairs for p in prefill[2:6]] == [
        chunk_pairs(s, n) for s, n in ((0, 64), (64, 64), (128, 64), (192, 8))
    ]
    decode = [p for p in profile.steps if p.decode_seqs and not p.prefill_tokens]
    assert [p.decode_seqs for p in decode] == [1, 1, 1, 4, 4, 4]
    # after a 32-token prompt the first decode step (untimed: it warms the shape) reads 33 keys, the next 34
    assert decode[0].decode_context == 34
    assert profile.cost.prefill_token_s > 0 and all(p.seconds > 0 for p in profile.steps)
    assert profile.cost.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # SmolLM2-135M: K and V, 30 layers, 3 heads
    assert [t.bytes for t in profile.transfers] == [16 * 46080, 64 * 46080]
    assert profile.step_fit.points == len(profile.steps) and profile.backend == "shm"
    # each prefill shape timed in 3 rounds of fresh prompts, kept once: the spread is the rounds' own
    assert 0 <= profile.prefill_spread[0] <= profile.prefill_spread[1]
    assert "spread between rounds" in profile.describe()


def test_a_pinned_profile_runs_on_its_cpu_and_measures_the_corun_factor(monkeypatch):
    from splitserve.config.engine import EngineConfig
    from splitserve.core.pinning import host_cpus
    from splitserve.plan import measure

    cpus = host_cpus()
    if len(cpus) < 2:
        pytest.skip("one CPU: no neighbour to co-run with")
    seen = {}

    def corun(engine, config, others, log):  # noqa: ANN001, ANN202
        seen.update(affinity=host_cpus(), others=list(others))
        return real(engine, config, others, log)

    real = measure.measure_corun
    monkeypatch.setattr(measure, "measure_corun", corun)
    from splitserve.plan import corun as corun_module

    # fewer and smaller timed steps than a real profile's: the test checks where they run, not their figure
    for name, value in (("ROUNDS", 2), ("ROUND_STEPS", 3), ("PROMPT_STEPS", 1), ("TIMED_BATCH", (2, 64)),
                        ("TIMED_PROMPT", 64)):  # fmt: skip
        monkeypatch.setattr(corun_module, name, value)
    grid = measure.Grid(
        prefill_lens=(32,), chunked_len=64, chunk_budget=32, decode_shapes=((1, 32), (2, 32)),
        decode_steps=2, transfer_blocks=(1, 2), transfer_reps=1,
    )  # fmt: skip
    config = EngineConfig(progress=False, kv_cache_bytes=64 << 20, max_model_len=512)
    profile = measure.profile_engine(config, "shm", threads=1, grid=grid, log=lambda *_: None, pinned=True)
    assert seen == {"affinity": cpus[:1], "others": cpus[1:2]}  # timed on its CPU, the neighbour on the next
    assert host_cpus() == cpus  # and let go afterwards
    assert profile.pinned and profile.cost.corun_factor >= 1.0
    assert "co-run" in profile.describe()


def test_repeated_prefill_shapes_are_kept_at_their_median_with_their_spread():
    from splitserve.plan.measure import median_by_shape

    a, b = (64, chunk_pairs(0, 64), 0, 0), (256, chunk_pairs(0, 256), 0, 0)
    rounds = [StepPoint(*a, 0.10), StepPoint(*b, 0.50), StepPoint(*a, 0.12), StepPoint(*b, 0.40)]
    rounds += [StepPoint(*a, 0.30), StepPoint(*b, 0.45)]  # a slow moment of the host meets one round
    points, spread = median_by_shape(rounds)
    assert points == [StepPoint(*a, 0.12), StepPoint(*b, 0.45)]  # first-seen order, the medians
    assert spread == pytest.approx([(0.30 - 0.10) / 0.12, (0.50 - 0.40) / 0.45])


def test_pooled_profiles_take_each_coefficients_median():
    def profile(scale: float, corun: float, spread: tuple[float, float]) -> Profile:
        cost = StepCost(
            base_s=0.02 * scale, prefill_token_s=0.002 * scale, decode_seq_s=0.0013, corun_factor=corun,
            latency_s=2e-4, bytes_per_s=8e9, kv_bytes_per_token=46080, request_s=0.009 * scale,
        )  # fmt: skip
        transfers = [TransferPoint(1 << 20, 2e-4 + (1 << 20) / 8e9)]
        _, step_fit, transfer_fit = fitted_cost(_points(cost), transfers, 46080, 0)
        return Profile(
            model="m", device="cpu", dtype="float32", threads=1, backend="shm", block_size=16,
            max_num_batched_tokens=2048, max_num_seqs=64, cost=cost, step_fit=step_fit,
            transfer_fit=transfer_fit, steps=_points(cost), transfers=transfers, measured_s=60.0,
            prefill_spread=spread,
        )  # fmt: skip

    # a profile taken while the host ran 10% slow, one 5% fast, one as usual: the usual one's costs
    slow, fast, usual = (
        profile(1.10, 1.3, (0.06, 0.11)),
        profile(0.95, 1.05, (0.03, 0.04)),
        profile(1.0, 1.07, (0.02, 0.03)),
    )
    p = pooled([slow, fast, usual])
    assert p.cost.prefill_token_s == pytest.approx(0.002) and p.cost.base_s == pytest.approx(0.02)
    assert p.cost.request_s == pytest.approx(0.009) and p.cost.corun_factor == pytest.approx(1.07)
    assert p.cost.kv_bytes_per_token == 46080 and isinstance(p.cost.kv_bytes_per_token, int)
    assert len(p.steps) == 3 * len(_points(TRUE)) and p.measured_s == 180.0
    assert p.prefill_spread == (0.03, 0.11)  # the median of the medians, the worst of the worsts
    assert pooled([usual]) is usual
    with pytest.raises(ValueError, match="cannot be pooled"):
        pooled([usual, msgspec.structs.replace(usual, threads=2)])
