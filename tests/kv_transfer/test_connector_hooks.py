"""The scheduler and the engine's side of KV transfer (engine/kv_transfer.py) with a fake connector: no
model, no transport, no threads (as vLLM's tests build `create_scheduler(use_kv_connector=True)`).
The fake records every hook the engine calls and the test posts its answers to the engine's inbox,
so each step of the contract in engine/kv_transfer_hooks.py is checked on its own: the connector is asked,
never allocates or frees; the engine holds blocks until the lease ends; a request waits in
WAITING_FOR_KV, polled without blocking, and joins (or follows its policy) when its load is posted."""

from __future__ import annotations

import time
from collections import Counter

import pytest
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.kv_transfer import KVTransfers
from splitserve.engine.kv_transfer_hooks import Inbox, KVLoad, LeaseEnded, LoadDone
from splitserve.engine.kv_transfer_types import ImportSpec, KVTransferFailed, NoRoom
from splitserve.engine.request import Request, RequestOutput, Status
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.state_pool import StatePool
from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams
from splitserve.transport import KVHandle, PeerRefused

BS = 4
NUM_BLOCKS = 8
OURS = "ours"


class FakeConnector:
    """kv_transfer_hooks.KVConnectorBase, recording what it is asked; the test posts its answers."""

    policy = "fail"
    fetch_timeout_s = 5.0
    holds_state = False

    def __init__(self, hold: bool = True) -> None:
        self.hold = hold
        self.inbox: Inbox | None = None
        self.finished: list[tuple[str, list[int]]] = []
        self.loads: list[KVLoad] = []
        self.discarded: list[KVHandle] = []
        self.counts: Counter[str] = Counter()
        self.failures: Counter[str] = Counter()

    def bind(self, inbox: Inbox) -> None:
        self.inbox = inbox

    def check_export(self, kv_transfer: str, n: int) -> None:
        if n != 1:
            raise ValueError("n > 1")

    def request_finished(self, req: Request, block_ids: list[int], state: object) -> object | None:
        self.finished.append((req.request_id, list(block_ids)))
        return f"export-of-{req.request_id}" if self.hold else None

    def accepts(self, handle: KVHandle) -> bool:
        return handle.layout_fingerprint == OURS

    def start_load(self, load: KVLoad) -> None:
        self.loads.append(load)

    def discard(self, handle: KVHandle) -> None:
        self.discarded.append(handle)

    def count(self, name: str, n: float = 1) -> None:
        self.counts[name] += n

    def count_failure(self, kind: str) -> None:
        self.failures[kind] += 1

    def post(self, message: object) -> None:
        assert self.inbox is not None
        self.inbox.post(message)


class FakeEngine:
    """The engine port the transfers use (kv_transfer.EnginePort): its bookkeeping, and nothing else."""

    def __init__(self, scheduler: Scheduler) -> None:
        self.scheduler = scheduler
        self.live: dict[str, Request] = {}
        self.outputs: list[RequestOutput] = []

    def build_request(self, prompt, params: SamplingParams, request_id: str) -> Request:
        if request_id in self.live:
            raise ValueError("in use")
        return Request(request_id, list(prompt), params, (), 8)

    def register(self, req: Request) -> None:
        self.live[req.request_id] = req

    def adopt(self, req: Request, first_token: int, logprob: TokenLogprob | None, computed: int) -> None:
        self.scheduler.kv_loaded(req, computed)
        req.output_token_ids.append(first_token)

    def forget(self, request_id: str) -> None:
        self.live.pop(request_id, None)

    def post_output(self, output: RequestOutput) -> None:
        self.outputs.append(output)

    def grammar_compiling(self, req: Request) -> bool:
        return False  # no request here has a grammar

    def grammar_late(self, since: float, timeout_s: float) -> bool:
        return False


class Setup:
    def __init__(self, hold: bool = True) -> None:
        self.pool = BlockPool(NUM_BLOCKS, enable_prefix_caching=False)
        self.sched = Scheduler(
            BlockManager(self.pool, BS), max_num_seqs=4, max_num_batched_tokens=64, max_model_len=64
        )
        self.engine = FakeEngine(self.sched)
        kv_cache = torch.zeros((NUM_BLOCKS, 2, BS))
        states = StatePool({}, 4, kv_cache.device)
        self.transfers = KVTransfers(self.engine, self.sched, kv_cache, states, vocab_size=100)
        self.conn = FakeConnector(hold)
        self.transfers.attach(self.conn)

    def spec(self, rid: str, prompt_len: int = 9, **kw) -> ImportSpec:
        layout = kw.pop("layout", OURS)
        handle = KVHandle("fake", "peer:1", rid, f"lease-{rid}", (0,), prompt_len, layout, time.time() + 60)
        return ImportSpec(handle, list(range(1, prompt_len + 1)), 42, SamplingParams(), rid, **kw)


def _prefilled(s: Setup, rid: str, prompt_len: int = 9) -> Request:
    """A request whose prompt has been computed in the scheduler (as a prefill step leaves it)."""
    req = Request(rid, list(range(prompt_len)), SamplingParams(), (), 8, export_kv=True)
    s.sched.add(req)
    (chunk,) = s.sched.schedule().chunks
    req.num_computed_tokens += chunk.num_tokens
    req.output_token_ids.append(7)  # the first token
    return req


def test_prefill_blocks_held_until_the_lease_ends():
    s = Setup()
    req = _prefilled(s, "p", prompt_len=9)  # 3 blocks for the prompt (+1 for its first token: none yet)
    prompt_blocks = list(req.block_ids[:3])
    s.transfers.export(req)
    assert s.conn.finished == [("p", prompt_blocks)]  # asked once, with the prompt's blocks
    assert req.finished and req.kv_export == "export-of-p" and not s.sched.has_work()
    assert s.pool.num_free == NUM_BLOCKS - 3  # held by the engine, not freed by anyone
    assert s.transfers.poll() == 0  # no lease ended yet: still held
    s.conn.post(LeaseEnded(tuple(prompt_blocks)))
    assert s.transfers.poll() == 3 and s.pool.num_free == NUM_BLOCKS
    assert s.conn.counts["lease_freed_blocks"] == 3


def test_prefill_not_held_frees_at_once():
    s = Setup(hold=False)
    req = _prefilled(s, "p")
    s.transfers.export(req)
    assert req.finished and req.kv_export is None and s.pool.num_free == NUM_BLOCKS


def test_decode_waits_for_kv_polled_without_blocking_then_joins():
    s = Setup()
    req = s.transfers.begin(s.spec("d", prompt_len=9))
    assert req.status is Status.WAITING_FOR_KV and s.sched.waiting_for_kv == [req]
    assert not s.sched.has_work() and not s.sched.schedule().chunks  # not schedulable while it waits
    assert s.pool.num_free == NUM_BLOCKS and not s.conn.loads  # room comes with the step's poll
    s.transfers.poll()
    (load,) = s.conn.loads
    assert load.request_id == "d" and load.block_ids == req.block_ids and len(load.block_ids) == 3
    s.transfers.poll()
    assert len(s.conn.loads) == 1  # started once; polling again neither blocks nor restarts it
    assert req.status is Status.WAITING_FOR_KV
    s.conn.post(LoadDone("d", nbytes=123))
    s.transfers.poll()
    assert req.status is Status.WAITING and s.sched.waiting[0] is req and not s.sched.waiting_for_kv
    assert req.num_computed_tokens == 9 and req.output_token_ids == [42]
    (out,) = s.transfers.take_outcomes()
    assert out.request_id == "d" and out.error is None and out.info["kv_bytes"] == 123
    (chunk,) = s.sched.schedule().chunks  # its next step computes the first token's KV alone
    assert chunk.request is req and chunk.start == 9 and chunk.num_tokens == 1


def test_decode_waits_for_room_until_its_deadline():
    s = Setup()
    hog = s.transfers.lease_blocks(NUM_BLOCKS - 1)
    req = s.transfers.begin(s.spec("d", timeout_s=0.2))
    s.transfers.poll()
    assert not s.conn.loads and req.status is Status.WAITING_FOR_KV  # no room yet: it waits
    assert s.transfers.num_held_blocks == NUM_BLOCKS - 1 and hog.nbytes == (NUM_BLOCKS - 1) * 2 * BS * 4
    s.transfers.release_blocks(hog.block_ids)
    s.transfers.poll()
    assert len(s.conn.loads) == 1  # room: the load starts
    s2 = Setup()
    s2.transfers.lease_blocks(NUM_BLOCKS - 1)
    s2.transfers.begin(s2.spec("late", timeout_s=0.05))
    time.sleep(0.06)
    s2.transfers.poll()
    (out,) = s2.transfers.take_outcomes()
    assert isinstance(out.error, KVTransferFailed) and isinstance(out.error.cause, NoRoom)
    assert s2.conn.discarded and "late" not in s2.engine.live  # the exporter's lease is let go


@pytest.mark.parametrize("policy", ["fail", "recompute"])
def test_failed_load_follows_the_policy(policy):
    s = Setup()
    req = s.transfers.begin(s.spec("d", policy=policy))
    s.transfers.poll()
    s.conn.post(LoadDone("d", TimeoutError("slow peer")))
    s.transfers.poll()
    assert s.conn.failures["TimeoutError"] == 1
    (out,) = s.transfers.take_outcomes()
    if policy == "fail":
        assert isinstance(out.error, KVTransferFailed) and req.finished and not s.sched.waiting
        assert s.pool.num_free == NUM_BLOCKS and "d" not in s.engine.live
    else:
        assert out.error is None and s.sched.waiting[0] is req and req.num_computed_tokens == 0
        assert req.block_ids == [] and s.pool.num_free == NUM_BLOCKS  # freed, recomputed from scratch


def test_foreign_handle_reserves_nothing_and_is_never_recomputed():
    s = Setup()
    s.transfers.begin(s.spec("d", layout="theirs", policy="recompute"))
    s.transfers.poll()
    (load,) = s.conn.loads
    assert load.block_ids == [] and s.pool.num_free == NUM_BLOCKS
    s.conn.post(LoadDone("d", PeerRefused("another model", ["model_fingerprint: ours a, peer b"])))
    s.transfers.poll()
    (out,) = s.transfers.take_outcomes()
    assert isinstance(out.error, KVTransferFailed) and isinstance(out.error.cause, PeerRefused)


def test_abort_before_and_during_the_load():
    s = Setup()
    waiting = s.transfers.begin(s.spec("a", timeout_s=5.0))
    s.transfers.abort(waiting)  # not started: ended now, its lease let go
    assert waiting.finish_reason == "abort" and s.conn.discarded and not s.conn.loads
    loading = s.transfers.begin(s.spec("b"))
    s.transfers.poll()
    s.transfers.abort(loading)  # in flight: its blocks stay out of use until the load ends
    assert s.pool.num_free == NUM_BLOCKS - 3 and not loading.finished
    s.conn.post(LoadDone("b"))
    s.transfers.poll()
    assert loading.finish_reason == "abort" and s.pool.num_free == NUM_BLOCKS
    assert [o.request_id for o in s.engine.outputs] == ["a", "b"] and s.conn.counts["aborted_imports"] == 2
