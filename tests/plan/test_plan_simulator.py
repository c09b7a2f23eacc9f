"""The planner's simulator on traces whose answers are computed by hand (the step-time model's
coefficients are set, not measured, so that every time below is a sum one can check on paper)."""

from __future__ import annotations

import math

import pytest

from splitserve.ab.metrics import SLO
from splitserve.ab.workload import BenchRequest, WorkloadSpec, at_rate, build_trace
from splitserve.plan.cost import StepCost, StepShape, chunk_pairs
from splitserve.plan.goodput import figures
from splitserve.plan.replica import EngineLimits
from splitserve.plan.simulator import Deployment, simulate

# a step: 10 ms + 1 ms per prompt token + 2 ms per decoding request; a handoff: 5 ms + 100 B/token at 1 MB/s
COST = StepCost(
    base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002,
    latency_s=0.005, bytes_per_s=1e6, kv_bytes_per_token=100,
)  # fmt: skip
BIG = EngineLimits(max_num_batched_tokens=4096, max_num_seqs=64)


def req(i: int, plen: int, out: int, t: float = 0.0, prompt: tuple[int, ...] | None = None) -> BenchRequest:
    ids = prompt if prompt is not None else tuple(range(1000 + 7 * i, 1000 + 7 * i + plen))
    return BenchRequest(i, ids, len(ids), out, arrival_s=t)


def test_one_request_disaggregated_first_token_as_the_prefill_worker_answers():
    """`router.first_token: prefill` (the router's default): the first token reaches the client as the
    prefill step ends; the handoff and the decode worker's first step fall in the first token gap."""
    run = simulate([req(0, 100, 5)], Deployment.split(1, 1, BIG), COST)
    (r,) = run.records
    prefill = 0.010 + 100 * 0.001  # one step of the whole prompt
    transfer = 0.005 + 100 * 100 / 1e6
    assert r.ttft_s == pytest.approx(prefill)
    assert r.itl_s == pytest.approx([transfer + 0.012] + [0.012] * 3)  # one decode step per token
    assert r.e2e_s == pytest.approx(prefill + transfer + 4 * 0.012)
    assert r.tpot_s == pytest.approx((transfer + 4 * 0.012) / 4)
    assert r.transfer_s == pytest.approx(transfer)
    assert run.replicas[0].prefill_tokens == 100 and run.replicas[1].prefill_tokens == 0


def test_one_request_disaggregated_first_token_once_the_decode_worker_has_the_kv():
    run = simulate([req(0, 100, 5)], Deployment.split(1, 1, BIG, first_token="decode"), COST)
    (r,) = run.records
    prefill, transfer = 0.110, 0.005 + 100 * 100 / 1e6
    assert r.ttft_s == pytest.approx(prefill + transfer)
    assert r.tpot_s == pytest.approx(0.010 + 0.002)
    assert r.itl_s == pytest.approx([0.012] * 4)
    with pytest.raises(ValueError, match="first_token"):
        Deployment.split(1, 1, BIG, first_token="router")


@pytest.mark.parametrize("first_token", ["prefill", "decode"])
def test_the_fixed_request_cost_delays_every_token_once(first_token: str):
    """`request_s` (the load client, router and front end): TTFT and e2e carry it once, token gaps not."""
    plain = simulate([req(0, 100, 5)], Deployment.split(1, 1, BIG, first_token=first_token), COST)
    cost = StepCost(**{**{f: getattr(COST, f) for f in COST.__struct_fields__}, "request_s": 0.007})
    late = simulate([req(0, 100, 5)], Deployment.split(1, 1, BIG, first_token=first_token), cost)
    (a,), (b,) = plain.records, late.records
    assert b.ttft_s == pytest.approx(a.ttft_s + 0.007) and b.e2e_s == pytest.approx(a.e2e_s + 0.007)
    assert b.itl_s == pytest.approx(a.itl_s)
    (c,) = simulate([req(0, 100, 5)], Deployment.colocated(1, BIG), cost).records
    assert c.ttft_s == pytest.approx(0.110 + 0.007) and c.tpot_s == pytest.approx(0.012)


def test_one_request_colocated_has_no_transfer():
    (r,) = simulate([req(0, 100, 5)], Deployment.colocated(1, BIG), COST).records
    assert r.ttft_s == pytest.approx(0.110)
    assert r.tpot_s == pytest.approx(0.012)
    assert r.transfer_s == 0


def test_a_burst_into_max_num_seqs_two_waits_one_service_time():
    limits = EngineLimits(max_num_batched_tokens=4096, max_num_seqs=2)
    run = simulate([req(i, 10, 3) for i in range(4)], Deployment.colocated(1, limits), COST)
    first_pair_prefill = 0.010 + 20 * 0.001  # both prompts in one step
    decode2 = 0.010 + 2 * 0.002  # two requests decoding
    service = first_pair_prefill + 2 * decode2  # 3 tokens: the prefill's and two decode steps
    r = run.records
    assert [r[0].ttft_s, r[1].ttft_s] == pytest.approx([first_pair_prefill] * 2)
    assert r[0].e2e_s == pytest.approx(service)
    # the third and fourth wait, exactly, for the first two to finish: one request's service time
    assert r[2].ttft_s == pytest.approx(service + first_pair_prefill)
    assert r[3].ttft_s == pytest.approx(service + first_pair_prefill)
    assert r[3].e2e_s == pytest.approx(2 * service)


@pytest.mark.parametrize("gap", [0.05, 0.2])
def test_a_prefill_queue_with_deterministic_arrivals(gap: float):
    """One prefill worker whose budget takes one prompt a step: service 110 ms; arrivals every `gap`.
    Request k starts prefill at max(k * gap, k * 0.110) (the queue), so TTFT_k is known in closed form."""
    limits = EngineLimits(max_num_batched_tokens=100, max_num_seqs=64)
    trace = [req(k, 100, 2, t=k * gap) for k in range(6)]
    run = simulate(trace, Deployment.split(1, 1, limits), COST)
    service = 0.110  # the first token streams as the prefill worker answers: the handoff is after it
    for k, r in enumerate(run.records):
        start = max(k * gap, k * service)
        assert r.ttft_s == pytest.approx(start + service - k * gap), k
    busy = run.replicas[0].busy_s
    assert busy == pytest.approx(6 * service)


def test_chunked_prefill_takes_ceil_of_length_over_budget_steps():
    cost = StepCost(base_s=0.010, prefill_token_s=0.001, prefill_pair_s=1e-7)
    limits = EngineLimits(max_num_batched_tokens=256, max_num_seqs=8)
    run = simulate([req(0, 1000, 1)], Deployment.colocated(1, limits), cost)
    (r,) = run.records
    steps = math.ceil(1000 / 256)
    assert run.replicas[0].steps == steps == 4
    # the chunks' query-key pairs add up to the whole causal prompt's: L (L + 1) / 2
    assert sum(chunk_pairs(s, min(256, 1000 - s)) for s in range(0, 1000, 256)) == 1000 * 1001 / 2
    assert r.ttft_s == pytest.approx(steps * 0.010 + 1000 * 0.001 + 1e-7 * 1000 * 1001 / 2)


def test_decode_rows_share_a_step_with_a_prefill_chunk():
    """Continuous batching: a request arriving while another decodes is prefilled in the same step as
    the other's decode row (one step: 10 ms + 50 prompt tokens + one decoding request)."""
    limits = EngineLimits(max_num_batched_tokens=4096, max_num_seqs=8)
    run = simulate([req(0, 50, 4), req(1, 50, 1, t=0.061)], Deployment.colocated(1, limits), COST)
    a, b = run.records
    # a: prefill 60 ms (ends 0.060), decode step 12 ms (ends 0.072); b arrives at 0.061 and joins at 0.072
    assert a.token_s[:2] == pytest.approx([0.060, 0.072])
    mixed = 0.010 + 50 * 0.001 + 0.002
    assert b.token_s[0] == pytest.approx(0.072 + mixed)
    assert a.token_s[2] == pytest.approx(0.072 + mixed)


def test_decode_time_grows_with_context():
    cost = StepCost(base_s=0.010, prefill_token_s=0.001, decode_context_s=1e-5)
    (r,) = simulate([req(0, 100, 3)], Deployment.colocated(1, BIG), cost).records
    # decode rows compute positions 100 and 101, reading 101 and 102 keys
    assert r.itl_s == pytest.approx([0.010 + 101e-5, 0.010 + 102e-5])
    assert cost.step_s(StepShape(decode_seqs=2, decode_context=203)) == pytest.approx(0.010 + 203e-5)


def test_a_shared_prefix_is_prefilled_once_per_replica():
    shared = tuple(range(500, 564))  # four full blocks of 16
    a = req(0, 0, 1, prompt=shared + (1, 2, 3, 4, 5))
    b = req(1, 0, 1, t=1.0, prompt=shared + (9, 8, 7))
    run = simulate([a, b], Deployment.colocated(1, BIG), COST)
    assert run.records[1].cached_tokens == 64
    assert run.records[1].ttft_s == pytest.approx(0.010 + 3 * 0.001)
    assert run.replicas[0].prefill_tokens == 69 + 3


def test_least_loaded_routing_spreads_a_burst_over_replicas():
    run = simulate([req(i, 100, 2) for i in range(4)], Deployment.split(2, 2, BIG), COST)
    # two prompts on each prefill worker, prefilled together: 10 ms + 200 tokens
    assert all(r.ttft_s == pytest.approx(0.210) for r in run.records)  # the first token as prefill answers
    assert [p.prefill_tokens for p in run.replicas[:2]] == [200, 200]


def test_ties_go_round_the_replicas_as_the_router_breaks_them():
    # each request ends before the next arrives, so every pick is a tie at 0 in flight: the router's
    # rotating start sends them to replicas 0, 1, 0
    run = simulate([req(i, 100, 2, t=float(i)) for i in range(3)], Deployment.colocated(2, BIG), COST)
    assert [r.prefill_tokens for r in run.replicas] == [200, 100]
    assert all(r.ttft_s == pytest.approx(0.110) for r in run.records)


def test_decode_steps_that_overlap_on_one_host_run_corun_factor_times_slower():
    # two replicas; a prompt step of 10 ms + 10 tokens = 20 ms, a decode step of 10 ms (twice that
    # while the other replica decodes too); prompt steps run at full speed whatever the other does
    slow = StepCost(base_s=0.010, prefill_token_s=0.001, corun_factor=2.0)
    both = simulate([req(0, 10, 3), req(1, 10, 3)], Deployment.colocated(2, BIG), slow)
    assert [r.token_s for r in both.records] == [pytest.approx([0.020, 0.040, 0.060])] * 2
    # b's prompt step runs beside a's decode steps: neither slows
    beside = simulate([req(0, 10, 3), req(1, 10, 1, t=0.020)], Deployment.colocated(2, BIG), slow)
    assert [r.token_s for r in beside.records] == [
        pytest.approx([0.020, 0.030, 0.040]),
        pytest.approx([0.040]),
    ]
    # partial overlaps: a decodes alone from 20 ms until b's prompt step ends at 25 ms (5 ms done),
    # then both decode: a's last 5 ms take 10 (ends at 35 ms), b's first step is half done by then;
    # a's next step starts beside it, b's last 5 ms take 10 (ends at 45 ms), a's step then runs its
    # last 5 ms alone (ends at 50 ms)
    partial = simulate([req(0, 10, 3), req(1, 10, 2, t=0.005)], Deployment.colocated(2, BIG), slow)
    assert [r.token_s for r in partial.records] == [
        pytest.approx([0.020, 0.035, 0.050]),
        pytest.approx([0.025, 0.045]),
    ]
    apart = simulate([req(0, 10, 2), req(1, 10, 2, t=0.2)], Deployment.colocated(2, BIG), slow)
    assert [r.tpot_s for r in apart.records] == pytest.approx([0.010, 0.010])  # no overlap: full speed


def test_a_step_beside_another_kind_of_step_runs_that_pairings_factor_slower():
    """Prompt steps beside a decoding worker x2, decode steps beside a prompt step x1.5, two prompt
    steps x1.5 (StepCost.corun); 10 ms a step + 1 ms a prompt token."""
    slow = StepCost(
        base_s=0.010, prefill_token_s=0.001, corun_prefill_factor=2.0, corun_decode_prefill_factor=1.5,
        corun_prefill_prefill_factor=1.5,
    )  # fmt: skip
    run = simulate([req(0, 10, 3), req(1, 10, 1, t=0.020)], Deployment.colocated(2, BIG), slow)
    a, b = run.records
    # a prefills alone (0-20 ms); then its two decode steps run beside b's prompt step at 2/3 speed
    # (15 ms each), while b's 20 ms of prompt work runs at half speed: 15 ms of it by 50 ms, the last
    # 5 ms alone
    assert a.token_s == pytest.approx([0.020, 0.035, 0.050])
    assert b.token_s == pytest.approx([0.055])
    both = simulate([req(0, 10, 1), req(1, 10, 1)], Deployment.colocated(2, BIG), slow)
    assert [r.token_s for r in both.records] == [pytest.approx([0.030])] * 2
    assert slow.corun(prompt=False, beside_prompt=False) == 1.0  # decode beside decode: unset here


def test_a_re_timed_step_ends_once_and_never_early():
    # many overlaps: an end pushed before a re-timing must not end the replica's next step
    slow = StepCost(base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002, corun_factor=1.5)
    spec = WorkloadSpec(kind="synthetic", num_prompts=40, seed=5)
    trace = at_rate(build_trace(spec), 8.0, 1.0, seed=5)
    run = simulate(trace, Deployment.colocated(2, BIG), slow)
    for r in run.records:
        assert r.ttft_s >= slow.prefill_s(r.prompt_len) - 1e-9
        assert min(r.itl_s) >= 0.012 - 1e-9  # a decode step of one request at full speed


def test_goodput_and_cost_follow_the_ab_definitions():
    limits = EngineLimits(max_num_batched_tokens=4096, max_num_seqs=2)
    run = simulate([req(i, 10, 3) for i in range(4)], Deployment.colocated(1, limits), COST)
    # TTFTs: 30, 30, 88, 88 ms; an SLO of 50 ms admits two
    fig = figures(run, SLO(ttft_ms=50, tpot_ms=100), usd_per_device_hour=3.6)
    assert fig.good == 2 and fig.attainment == 0.5
    assert fig.duration_s == pytest.approx(0.116)
    assert fig.goodput_rps == pytest.approx(2 / 0.116)
    assert fig.usd_per_accepted == pytest.approx(3.6 * 0.116 / 3600 / 2)
    assert fig.goodput_per_device == fig.goodput_rps


def test_a_run_is_a_function_of_its_inputs():
    spec = WorkloadSpec(kind="rag", num_prompts=30, seed=3)
    trace = at_rate(build_trace(spec), 4.0, 1.0, seed=3)
    one = simulate(trace, Deployment.split(1, 2, BIG), COST)
    two = simulate(trace, Deployment.split(1, 2, BIG), COST)
    assert [r.token_s for r in one.records] == [r.token_s for r in two.records]
    assert all(len(r.token_s) == r.output_len for r in one.records)


def test_agent_turns_arrive_a_think_time_after_the_previous_turn():
    spec = WorkloadSpec(kind="agent", num_prompts=6, seed=1, turns=(3, 3), think_s=0.5)
    trace = at_rate(build_trace(spec), 1.0, 1.0, seed=1)
    run = simulate(trace, Deployment.colocated(1, BIG), COST)
    by_index = {r.index: r for r in run.records}
    for t in trace:
        if t.turn > 0:
            prev = next(p for p in trace if p.session == t.session and p.turn == t.turn - 1)
            assert by_index[t.index].arrival_s == pytest.approx(by_index[prev.index].token_s[-1] + t.think_s)


def test_served_factors_stretch_prompt_steps_and_decode_steps_apart():
    cost = StepCost(
        base_s=0.010, prefill_token_s=0.001, decode_seq_s=0.002, served_factor=1.1, served_decode_factor=1.5
    )
    (r,) = simulate([req(0, 100, 3)], Deployment.colocated(1, BIG), cost).records
    assert r.ttft_s == pytest.approx(0.110 * 1.1)
    assert r.itl_s == pytest.approx([0.012 * 1.5] * 2)
    mixed = StepShape(prefill_tokens=10, prefill_pairs=chunk_pairs(0, 10), decode_seqs=1)
    assert cost.step_s(mixed) == pytest.approx(1.1 * (0.010 + 0.010 + 0.002))  # a prompt step's factor
