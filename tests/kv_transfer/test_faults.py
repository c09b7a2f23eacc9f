"""Every error path of a disaggregated request, between real worker processes (tiny Qwen3.5).

The prefill worker (the backend's pair, shared with test_disaggregated_qwen3_5:
kv_transfer_helpers.QwenPairs) runs with fault injection (its exporter drops, stalls, corrupts or hangs
up on the fetches it serves), checksums on and a short lease. For each fault and each policy the request
ends within its deadline: "fail" with a clear HTTP error naming the failure, "recompute" with exactly
the colocated tokens. Both workers' block pools and state slots are full again afterwards, and each
failure is counted by kind. Also: an unclaimed export expires, a prefill process killed in the middle of
a transfer, and an abort while the fetch is in flight.
"""

from __future__ import annotations

import contextlib
import threading
import time

import pytest
from kv_transfer_helpers import (
    LEASE_S,
    NIXL,
    WorkerProcess,
    assert_pools_full,
    decode,
    prefill,
    random_prompts,
    wait_for,
)

pytestmark = pytest.mark.slow

DEADLINE_S = 1.0
SLACK_S = 5.0  # HTTP and a busy 2-core machine on top of a deadline
GREEDY = {"temperature": 0, "max_tokens": 12, "ignore_eos": True}
PROMPT = random_prompts([40], seed=5)[0]  # three blocks (shm direct corrupts by rotating block ids)


@pytest.fixture(scope="module")
def pair(request, qwen_pairs):
    """The backend's shared pair (kv_transfer_helpers.QwenPairs), and the colocated answer."""
    p, d = qwen_pairs.get(request.param)
    return p, d, d.generate(PROMPT, GREEDY)


@contextlib.contextmanager
def faults(p: WorkerProcess, **knobs: float):
    assert p.post("/debug/faults", knobs).status_code == 200
    try:
        yield
    finally:
        assert p.post("/debug/faults", {}).status_code == 200


def _both_policies(p, d, reference, kind: str, status: int, timeout_s: float = DEADLINE_S) -> None:
    before = d.stats()["kv_transfer"]["failures"].get(kind, 0)
    res = decode(d, PROMPT, prefill(p, PROMPT, GREEDY), GREEDY, kv_policy="fail", timeout_s=timeout_s)
    assert res.status == status, res.body
    err = res.body["error"]
    assert err["type"] == "kv_transfer_failed" and err["kind"] == kind, err
    assert res.seconds < timeout_s + SLACK_S
    res = decode(d, PROMPT, prefill(p, PROMPT, GREEDY), GREEDY, kv_policy="recompute", timeout_s=timeout_s)
    assert res.status == 200, res.body
    assert res.tokens == reference
    assert d.stats()["kv_transfer"]["failures"][kind] == before + 2


@pytest.mark.parametrize("pair", ["tcp", NIXL], indirect=True)
def test_dropped_fetch_times_out(pair):
    p, d, reference = pair
    with faults(p, drop=1.0):
        _both_policies(p, d, reference, "TransferTimeout", 504)
    assert_pools_full(p, d)


@pytest.mark.parametrize("pair", ["tcp", NIXL], indirect=True)
def test_delay_past_deadline(pair):
    p, d, reference = pair
    with faults(p, delay=1.0, delay_s=DEADLINE_S + 1.5):
        _both_policies(p, d, reference, "TransferTimeout", 504)
    assert_pools_full(p, d)  # the stalled exporter lets go once its late answer fails


@pytest.mark.parametrize("pair", ["tcp", "shm", NIXL], indirect=True)
def test_corruption_caught_by_checksum(pair):
    p, d, reference = pair
    with faults(p, corrupt=1.0):
        _both_policies(p, d, reference, "CorruptTransfer", 502, timeout_s=10.0)
    assert_pools_full(p, d)


@pytest.mark.parametrize("pair", ["tcp", "shm", NIXL], indirect=True)
def test_peer_hangs_up_mid_transfer(pair):
    p, d, reference = pair
    with faults(p, kill=1.0):
        _both_policies(p, d, reference, "TransportError", 502, timeout_s=10.0)
    assert_pools_full(p, d)


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_unclaimed_export_expires(pair):
    p, d, reference = pair
    pre = [prefill(p, PROMPT, GREEDY) for _ in range(2)]
    held = p.stats()["blocks"]
    assert held["free"] < held["total"]
    assert_pools_full(p, timeout_s=LEASE_S + SLACK_S)  # nobody fetched: the leases ran out
    res = decode(d, PROMPT, pre[0], GREEDY, kv_policy="fail")
    assert res.status == 502 and res.body["error"]["kind"] == "LeaseExpired", res.body
    res = decode(d, PROMPT, pre[1], GREEDY, kv_policy="recompute")
    assert res.status == 200 and res.tokens == reference
    assert_pools_full(p, d)


@pytest.mark.parametrize("pair", ["tcp"], indirect=True)
def test_abort_while_fetching(pair):
    p, d, _ = pair
    with faults(p, delay=1.0, delay_s=4.0):  # long enough for the abort to land mid-fetch
        pre = prefill(p, PROMPT, GREEDY)
        out: dict = {}
        t = threading.Thread(
            target=lambda: out.setdefault("res", decode(d, PROMPT, pre, GREEDY, timeout_s=10))
        )
        t.start()
        assert wait_for(lambda: d.stats()["kv_transfer"]["importing"] == 1, 5.0)
        assert d.post("/abort", {"request_id": pre["request_id"]}).status_code == 200
        t.join(timeout=15)
    res = out["res"]
    assert res.status == 200 and res.body["finish_reason"] == "abort", res.body
    assert d.stats()["kv_transfer"]["counts"]["aborted_imports"] >= 1
    assert_pools_full(p, d)


# NOTE: last in this module: it kills the shared pair's prefill worker (then discards the pair, so a
# later module starts a fresh one); pytest runs a module's tests of one `pair` param in file order.
@pytest.mark.parametrize("pair", ["tcp", NIXL], indirect=True)
def test_prefill_process_killed_mid_transfer(pair, qwen_pairs, request):
    """SIGKILL the prefill worker while it serves two fetches: both decodes end at once, not at their
    deadline; "fail" reports the lost peer, "recompute" answers correctly; decode's pool is full."""
    p, d, reference = pair
    try:
        pres = [prefill(p, PROMPT, GREEDY) for _ in range(2)]
        assert p.post("/debug/faults", {"delay": 1.0, "delay_s": 60.0}).status_code == 200
        results: dict = {}

        def run(policy: str, pre: dict) -> None:
            results[policy] = decode(d, PROMPT, pre, GREEDY, kv_policy=policy, timeout_s=30.0)

        threads = [
            threading.Thread(target=run, args=a) for a in zip(["fail", "recompute"], pres, strict=True)
        ]
        for t in threads:
            t.start()
        assert wait_for(lambda: d.stats()["kv_transfer"]["importing"] == 2, 10.0)
        time.sleep(0.3)  # both fetches are now stalled inside the exporter
        p.kill()
        for t in threads:
            t.join(timeout=40)
        fail, recompute = results["fail"], results["recompute"]
        assert fail.status == 502 and fail.body["error"]["kind"] == "TransportError", fail.body
        assert fail.seconds < 30.0 / 2 and recompute.seconds < 30.0 / 2
        assert recompute.status == 200 and recompute.tokens == reference
        assert_pools_full(d)
    finally:
        qwen_pairs.discard(request.node.callspec.params["pair"])
