"""KVConnector in one process (tiny Qwen3.5: blocks and recurrent state), through the library API:
`add_request(kv_transfer="export")` on a prefill engine, `add_request_with_kv` on a decode engine.
Fast: no worker processes. The process tests (test_disagg_*, test_faults) cover the service."""

from __future__ import annotations

import time

import pytest
from kv_transfer_helpers import SECRET, random_prompts
from tp_pd_engines import run as _run

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.kv_connector import KVConnector, KVExport, KVTransferFailed, NoRoom
from splitserve.transport import TransportOptions

GREEDY = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
PROMPTS = random_prompts((5, 40), seed=3)


pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture
def make(tiny_qwen, tiny_qwen_loaded):
    """make(kv_mb=4, lease_s=30, policy="fail") -> (engine, connector or None); closed after the test."""
    made: list[KVConnector] = []

    def _make(connect: bool = True, kv_bytes: int = 4 << 20, lease_s: float = 30.0, policy: str = "fail"):
        config = EngineConfig(model=str(tiny_qwen), max_model_len=256, kv_cache_bytes=kv_bytes,
                              max_num_seqs=4, progress=False)  # fmt: skip
        engine = LLMEngine(config, tokenizer=None, loaded=tiny_qwen_loaded)
        if not connect:
            return engine, None
        options = TransportOptions(lease_s=lease_s, fetch_timeout_s=5.0)
        conn = KVConnector.open(engine, "tcp", secret=SECRET, options=options, policy=policy)
        made.append(conn)
        return engine, conn

    yield _make
    for conn in made:
        conn.close()


def _prefill(engine: LLMEngine, prompts, params=GREEDY) -> list:
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"r{i}", kv_transfer="export")
    done = _run(engine)
    return [done[f"r{i}"] for i in range(len(prompts))]


def _full(engine: LLMEngine) -> bool:
    engine.free_released_kv()
    return (
        engine.pool.num_free == engine.pool.num_blocks and engine.states.num_free == engine.states.num_slots
    )


def _colocated(engine: LLMEngine, prompts, params=GREEDY) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"c{i}")
    done = _run(engine)
    return [done[f"c{i}"].outputs[0].token_ids for i in range(len(prompts))]


def _import_all(d: LLMEngine, prompts, outs, params=GREEDY, with_state=True) -> list[list[int]]:
    for i, (p, out) in enumerate(zip(prompts, outs, strict=True)):
        ex: KVExport = out.kv_export
        state = ex.generator_state if with_state else None
        d.add_request_with_kv(
            ex.handle, p, out.outputs[0].token_ids[0], params, f"d{i}", generator_state=state
        )
    done = _run(d)
    return [done[f"d{i}"].outputs[0].token_ids for i in range(len(prompts))]


def test_export_then_import_equals_colocated(make):
    (p, pc), (d, _) = make(), make()
    outs = _prefill(p, PROMPTS)
    assert all(o.finished and o.outputs[0].finish_reason is None for o in outs)  # continues elsewhere
    assert p.states.num_free == p.states.num_slots  # the state was copied at export: slots are back
    assert p.pool.num_free < p.pool.num_blocks  # the blocks are leased
    assert _import_all(d, PROMPTS, outs) == _colocated(d, PROMPTS)
    assert _full(d)
    deadline = time.monotonic() + 5
    while not _full(p) and time.monotonic() < deadline:  # released by decode in the background
        time.sleep(0.02)
    assert _full(p)
    assert pc.counts["exports"] == len(PROMPTS) and pc.counts["lease_freed_blocks"] > 0


def test_an_imported_first_token_comes_out_before_the_next_forward_pass(make):
    """TTFT on the decode side: the step after an import returns the first token (sampled by the
    prefill engine) alone, without running the model; the step after that runs it."""
    (p, _), (d, _) = make(), make()
    out = _prefill(p, PROMPTS[:1])[0]
    first = out.outputs[0].token_ids[0]
    d.add_request_with_kv(out.kv_export.handle, PROMPTS[0], first, GREEDY, "d0",
                          generator_state=out.kv_export.generator_state)  # fmt: skip
    before = d.forward_steps
    outs = d.step()
    assert [o.outputs[0].token_ids for o in outs] == [[first]] and d.forward_steps == before
    outs = d.step()
    assert d.forward_steps == before + 1 and outs[0].outputs[0].token_ids[0] == first
    assert len(outs[0].outputs[0].token_ids) == 2
    _run(d)
    assert _full(d)


def test_the_state_really_moves(make, monkeypatch):
    """Negative control: continuing from a zero recurrent state gives other tokens."""
    (p, _), (d, _) = make(), make()
    outs = _prefill(p, PROMPTS[1:])
    monkeypatch.setattr(d.transfers, "_load_state", lambda req, state: None)
    assert _import_all(d, PROMPTS[1:], outs) != _colocated(d, PROMPTS[1:])


def test_seeded_without_generator_state_replays_the_first_draw(make):
    (p, _), (d, _) = make(), make()
    params = SamplingParams(temperature=1.0, seed=11, max_tokens=10, ignore_eos=True)
    outs = _prefill(p, PROMPTS, params)
    assert all(o.kv_export.generator_state for o in outs)
    assert _import_all(d, PROMPTS, outs, params, with_state=False) == _colocated(d, PROMPTS, params)


def test_unclaimed_export_expires(make):
    p, _ = make(lease_s=0.3)
    _prefill(p, PROMPTS)
    assert p.pool.num_free < p.pool.num_blocks
    time.sleep(0.6)
    assert _full(p)  # the reaper ended the leases; free_released_kv gave the blocks back


def test_no_room_follows_the_policy(make):
    (p, _), (d, dc) = make(), make(kv_bytes=4 * 16 * 2 * 2 * 2 * 32 * 4)  # 4 blocks of 16 tokens
    long_prompt = random_prompts([40], seed=4)[0]  # needs 3 blocks
    d.add_request(long_prompt, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True), "hog")
    d.step()  # the hog holds 3 of 4 blocks
    outs = _prefill(p, [long_prompt, long_prompt])
    ex = [o.kv_export for o in outs]
    with pytest.raises(KVTransferFailed) as info:
        d.add_request_with_kv(ex[0].handle, long_prompt, outs[0].outputs[0].token_ids[0], GREEDY, "x")
    assert isinstance(info.value.cause, NoRoom) and dc.failures["NoRoom"] == 1
    d.add_request_with_kv(ex[1].handle, long_prompt, outs[1].outputs[0].token_ids[0], GREEDY, "y",
                          policy="recompute")  # fmt: skip
    done = _run(d)  # "y" waits for the hog's blocks, then recomputes its prompt
    assert done["y"].outputs[0].token_ids == _colocated(d, [long_prompt])[0]
    assert _full(d) and dc.counts["recomputed"] == 1


def test_first_token_that_ends_the_request_is_not_exported(make):
    p, pc = make()
    (out,) = _prefill(p, PROMPTS[:1], SamplingParams(temperature=0, max_tokens=1))
    assert out.kv_export is None and out.outputs[0].finish_reason == "length"
    assert _full(p) and pc.counts["exports"] == 0


def test_bad_requests_hold_nothing(make):
    (p, _), (d, _) = make(), make()
    with pytest.raises(ValueError, match="n > 1"):
        p.add_request(PROMPTS[0], SamplingParams(n=2), kv_transfer="export")
    with pytest.raises(ValueError, match="kv_transfer"):
        p.add_request(PROMPTS[0], GREEDY, kv_transfer="import")
    plain, _ = make(connect=False)
    with pytest.raises(ValueError, match="no KV connector"):
        plain.add_request(PROMPTS[0], GREEDY, kv_transfer="export")
    (out,) = _prefill(p, PROMPTS[1:])
    with pytest.raises(ValueError, match="another prompt"):
        d.add_request_with_kv(out.kv_export.handle, PROMPTS[0], 7, GREEDY, "z")
    assert _full(d) and not d.has_unfinished_requests()


class _LateCopy:
    """A stand-in for the CUDA event after a cuda_ipc copy that ran past its fetch's deadline (no GPU
    here): `query()` is False until the test says the copy has ended."""

    def __init__(self) -> None:
        self.ended = False

    def query(self) -> bool:
        return self.ended


def test_blocks_a_late_copy_may_still_write_stay_out_of_use_until_it_ends(make, monkeypatch):
    """A fetch that fails while its copy may still be writing the blocks (TransportError.pending):
    the request recomputes (policy) into other blocks, the engine goes on, and the blocks come back
    to the pool only once the copy has ended."""
    from splitserve.transport import TransferTimeout

    (p, _), (d, dc) = make(), make(policy="recompute")
    outs = _prefill(p, PROMPTS[:1])
    late = _LateCopy()

    def fetch(handle, into_block_ids, timeout_s=None, into_state=None):
        exc = TransferTimeout("cuda_ipc copy from the exporter: deadline passed")
        exc.pending = late
        raise exc

    monkeypatch.setattr(dc.transport, "fetch", fetch)
    held, given = [], []
    free_after, allocate = d.pool.free_after, d.pool.allocate
    monkeypatch.setattr(d.pool, "free_after", lambda ids, done: held.extend(ids) or free_after(ids, done))

    def allocating(n: int) -> list[int]:
        out = allocate(n)
        if held:  # while the late copy may still write the held blocks
            given.extend(out)
        return out

    monkeypatch.setattr(d.pool, "allocate", allocating)
    assert _import_all(d, PROMPTS[:1], outs) == _colocated(d, PROMPTS[:1])  # recomputed, right
    assert held and given and d.pool.num_held == len(held) and not set(held) & set(given)
    assert not _full(d) and dc.failures["TransferTimeout"] == 1 and dc.counts["recomputed"] == 1
    late.ended = True
    assert _full(d) and d.pool.num_held == 0
