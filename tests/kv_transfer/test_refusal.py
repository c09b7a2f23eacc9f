"""A decode peer that does not match the prefill worker (other model, dtype or block size) or cannot
prove the shared secret is refused at connect, before any KV moves, with a message naming the
difference; the refusal is not recomputed over (a first token from another model cannot be continued)
and counted on both sides; the decode side's blocks come back, and the prefill side's on release.

The prefill worker is a real process; most decode peers are engines in this process (cheap to build
with odd settings), driven through `LLMEngine.add_request_with_kv`; two are worker processes, to
pin the HTTP answers (403, 409) of /decode and /kv/connect.
"""

from __future__ import annotations

import msgspec
import pytest
from kv_transfer_helpers import (
    SECRET,
    TINY_ARGS,
    WorkerProcess,
    assert_pools_full,
    prefill,
    random_prompts,
    start_workers,
    wait_for,
)

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.kv_connector import KVConnector, KVExport, KVTransferFailed
from splitserve.transport import AuthError, PeerRefused, TransportOptions

pytestmark = pytest.mark.slow

GREEDY = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
PROMPT = random_prompts([40], seed=9)[0]


@pytest.fixture(scope="module")
def workers(tiny_qwen):
    model = ("--model", str(tiny_qwen), *TINY_ARGS)
    p = WorkerProcess("prefill", *model)
    bad_secret = WorkerProcess("decode", *model, secret="not-the-secret")
    bad_block = WorkerProcess("decode", *model, "--block-size", "32")
    start_workers(p, bad_secret, bad_block)
    yield p, bad_secret, bad_block
    for w in (p, bad_secret, bad_block):
        w.stop()


def _engine(model, secret: str = SECRET, **knobs) -> tuple[LLMEngine, KVConnector]:
    config = EngineConfig(model=str(model), max_model_len=256, kv_cache_bytes=4 << 20, max_num_seqs=4,
                          progress=False, **knobs)  # fmt: skip
    engine = LLMEngine(config, tokenizer=None)
    options = TransportOptions(connect_timeout_s=5.0, fetch_timeout_s=10.0)
    return engine, KVConnector.open(engine, "tcp", secret=secret, options=options, policy="recompute")


def _import(engine: LLMEngine, pre: dict) -> KVTransferFailed:
    export = msgspec.convert(pre["kv_export"], KVExport)
    with pytest.raises(KVTransferFailed) as info:
        engine.add_request_with_kv(export.handle, PROMPT, pre["first_token"], SamplingParams(**GREEDY),
                                   generator_state=export.generator_state)  # fmt: skip
    assert not engine.has_unfinished_requests()
    assert engine.pool.num_free == engine.pool.num_blocks
    assert engine.states.num_free == engine.states.num_slots
    return info.value


@pytest.mark.parametrize(
    ("knobs", "field"),
    [({"block_size": 32}, "block_size"), ({"dtype": "bfloat16"}, "dtype"), ({}, "model_fingerprint")],
    ids=["block_size", "dtype", "model"],
)
def test_mismatched_peer_refused(workers, tiny_qwen, other_tiny_qwen, knobs, field):
    p, _, _ = workers
    engine, conn = _engine(other_tiny_qwen if field == "model_fingerprint" else tiny_qwen, **knobs)
    try:
        pre = prefill(p, PROMPT, GREEDY)
        err = _import(engine, pre)  # NOTE: the connector's policy is "recompute": refusals still fail
        assert isinstance(err.cause, PeerRefused)
        assert [m for m in err.cause.mismatches if m.startswith(f"{field}:")], err.cause.mismatches
        assert f"{field}: ours" in str(err)
        assert conn.failures["PeerRefused"] == 1 and conn.counts["failed"] == 1
        assert conn.stats()["transport"].counts.get("fetches", 0) == 0  # no KV moved
        assert p.post("/kv/release", {"kv_export": pre["kv_export"]}).status_code == 200
        assert_pools_full(p)
    finally:
        conn.close()
    server = p.stats()["kv_transfer"]["transport"]["server"]
    assert server.get("refused_layout", 0) >= 1


def test_wrong_secret_refused(workers, tiny_qwen):
    p, _, _ = workers
    engine, conn = _engine(tiny_qwen, secret="wrong")
    try:
        pre = prefill(p, PROMPT, GREEDY)
        err = _import(engine, pre)
        assert isinstance(err.cause, AuthError)
        assert p.post("/kv/release", {"kv_export": pre["kv_export"]}).status_code == 200
        assert_pools_full(p)
    finally:
        conn.close()
    assert wait_for(lambda: p.stats()["kv_transfer"]["transport"]["server"].get("refused_auth", 0) >= 1)


def test_http_answers_for_refused_peers(workers):
    p, bad_secret, bad_block = workers
    address = p.info["kv_address"]
    r = bad_secret.post("/kv/connect", {"address": address})
    assert r.status_code == 403 and r.json()["error"]["kind"] == "AuthError", r.text
    r = bad_block.post("/kv/connect", {"address": address})
    assert r.status_code == 409, r.text
    assert "block_size: ours 32, peer 16" in r.json()["error"]["mismatches"]
    pre = prefill(p, PROMPT, GREEDY)
    body = {"prompt_token_ids": PROMPT, "first_token": pre["first_token"], "kv_export": pre["kv_export"],
            "sampling_params": GREEDY, "kv_policy": "recompute"}  # fmt: skip
    r = bad_secret.post("/decode", body)
    assert r.status_code == 403 and r.json()["error"]["kind"] == "AuthError", r.text
    r = bad_block.post("/decode", body)
    assert r.status_code == 409 and r.json()["error"]["kind"] == "PeerRefused", r.text
    assert p.post("/kv/release", {"kv_export": pre["kv_export"]}).status_code == 200
    assert_pools_full(p, bad_secret, bad_block)
