"""Trace generation: length distributions, arrivals, the workload kinds, JSONL replay; seeds repeat."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from splitserve.ab.workload import (
    LengthDist,
    WorkloadSpec,
    arrival_offsets,
    at_rate,
    build_trace,
    load_trace,
    sweep_traces,
    write_trace,
)


def test_length_specs_parse_and_sample():
    rng = np.random.default_rng(0)
    assert (LengthDist.parse("fixed:256").sample(rng, 5) == 256).all()
    u = LengthDist.parse("uniform:128:512").sample(rng, 2000)
    assert u.min() >= 128 and u.max() <= 512 and abs(u.mean() - 320) < 10
    ln = LengthDist.parse("lognormal:200:0.5").sample(rng, 4000)
    assert abs(np.median(ln) - 200) < 10
    assert LengthDist.parse("lognormal:200:3").sample(rng, 1000, 1, 500).max() <= 500
    assert str(LengthDist.parse("uniform:1:2")) == "uniform:1:2"
    for bad in ("fixed", "uniform:5", "uniform:9:3", "gauss:1:2", "fixed:x", "fixed:0"):
        with pytest.raises(ValueError, match="length spec"):
            LengthDist.parse(bad)


def test_arrivals_follow_vllm():
    rng = np.random.default_rng(1)
    t = arrival_offsets(rng, 50, 2.0)
    assert (np.diff(t) >= 0).all() and t[0] > 0
    assert t[-1] == pytest.approx(25.0)  # rescaled: the last request is due at n / rate
    assert (arrival_offsets(rng, 5, math.inf) == 0).all()
    bursty = arrival_offsets(np.random.default_rng(1), 2000, 1.0, burstiness=0.2)
    smooth = arrival_offsets(np.random.default_rng(1), 2000, 1.0, burstiness=20)
    assert np.diff(bursty).std() > 3 * np.diff(smooth).std()  # gamma shape: CV = 1 / sqrt(shape)
    gaps = np.diff(arrival_offsets(np.random.default_rng(2), 5000, 4.0))
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, abs=0.05)  # Poisson: exponential gaps


def test_synthetic_trace_is_repeatable_and_bounded():
    spec = WorkloadSpec(num_prompts=30, input_len=LengthDist("uniform", 100, 1900), max_model_len=1024)
    a, b = build_trace(spec), build_trace(spec)
    assert a == b
    assert build_trace(WorkloadSpec(num_prompts=30, seed=1)) != build_trace(WorkloadSpec(num_prompts=30))
    for r in a:
        assert len(r.prompt) == r.prompt_len
        assert r.prompt_len + r.output_len < 1024
        assert 32 <= r.output_len <= 64
        assert all(100 <= t < 32000 for t in r.prompt)


def test_a_sweep_keeps_the_requests_and_scales_arrivals():
    trace = build_trace(WorkloadSpec(num_prompts=20))
    slow, fast = at_rate(trace, 1.0, 1.0, 0), at_rate(trace, 2.0, 1.0, 0)
    assert [r.prompt for r in slow] == [r.prompt for r in fast]
    assert [r.arrival_s / 2 for r in slow] == pytest.approx([r.arrival_s for r in fast])
    assert slow == at_rate(trace, 1.0, 1.0, 0)


def test_each_rate_of_a_sweep_has_fresh_prompts_of_the_same_kind():
    spec = WorkloadSpec(num_prompts=10)
    a, b = sweep_traces(spec, 2)
    assert a == build_trace(spec) and b != a
    assert not {r.prompt for r in a} & {r.prompt for r in b}  # no prefix-cache hits across rates
    assert sweep_traces(spec, 2) == [a, b]


def test_rag_prompts_share_popular_chunks():
    trace = build_trace(WorkloadSpec(kind="rag", num_prompts=40))
    heads = [r.prompt[:192] for r in trace]
    assert len(set(heads)) < len(heads)  # popular chunks come first again
    assert all(r.kind == "rag" and 3 * 192 < r.prompt_len < 2048 and r.output_len >= 32 for r in trace)
    mix = build_trace(WorkloadSpec(kind="long-mix", num_prompts=200, long_fraction=0.3))
    long = sum(r.kind != "chat" for r in mix)
    assert 35 <= long <= 85


def test_agent_sessions_extend_their_history():
    spec = WorkloadSpec(kind="agent", num_prompts=30, system_prompt_len=64, input_len=LengthDist("fixed", 20))
    trace = build_trace(spec)
    assert len(trace) == 30
    system = trace[0].prompt[:64]
    assert all(r.prompt[:64] == system for r in trace)  # one prefix shared by every session
    by_session: dict[int, list] = {}
    for r in trace:
        by_session.setdefault(r.session, []).append(r)
    assert len(by_session) > 1
    for turns in by_session.values():
        assert [t.turn for t in turns] == list(range(len(turns)))
        for prev, nxt in zip(turns, turns[1:], strict=False):
            assert nxt.prompt[: prev.prompt_len] == prev.prompt  # the whole history is resent
            assert nxt.prompt_len == prev.prompt_len + prev.output_len + 20
            assert nxt.think_s >= 0
    timed = at_rate(trace, 1.0, 1.0, 0)
    assert all((r.arrival_s > 0) == (r.turn == 0) for r in timed)


def test_replay_reads_lengths_text_and_timestamps(tmp_path):
    path = tmp_path / "t.jsonl"
    lines = [
        {"timestamp": 2.5, "prompt_len": 50, "output_len": 8},
        {"timestamp": 1.0, "prompt": "Hello there", "output_len": 4},
        {"timestamp_ms": 4000, "input_length": 3000, "output_length": 16},
    ]
    path.write_text("# a comment\n" + "\n".join(json.dumps(x) for x in lines) + "\n\n")
    trace = load_trace(path, max_model_len=1024)
    assert [r.arrival_s for r in trace] == [0.0, 1.5, 3.0]
    assert trace[0].prompt == "Hello there" and trace[0].output_len == 4
    assert trace[1].prompt_len == 50 and len(trace[1].prompt) == 50
    assert trace[2].prompt_len == 1024 - 16 - 1  # cut to fit max_model_len
    assert at_rate(trace, None, 1.0, 0) == trace  # as recorded
    doubled = at_rate(trace, 1.0, 1.0, 0)  # 3 requests over 3 s -> 1 req/s wants the span 3 s
    assert [r.arrival_s for r in doubled] == pytest.approx([0.0, 1.5, 3.0])
    fast = at_rate(trace, 2.0, 1.0, 0)
    assert [r.arrival_s for r in fast] == pytest.approx([0.0, 0.75, 1.5])
    out = tmp_path / "back.jsonl"
    write_trace(out, trace)
    again = load_trace(out, max_model_len=1024)
    assert [(r.arrival_s, r.prompt_len, r.output_len) for r in again] == [
        (r.arrival_s, r.prompt_len, r.output_len) for r in trace
    ]


@pytest.mark.parametrize(
    "line, word",
    [("{not json", "not a trace line"), ('{"prompt_len": 5}', "output_len"), ('{"output_len": 3}', "prompt")],
)
def test_bad_replay_lines_name_the_line(tmp_path, line, word):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt_len": 5, "output_len": 2}\n' + line + "\n")
    with pytest.raises(ValueError, match=f"bad.jsonl:2: .*{word}"):
        load_trace(path)
