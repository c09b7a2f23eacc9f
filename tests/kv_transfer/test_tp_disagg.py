"""Prefill and decode at different tensor-parallel sizes, engine to engine in one process (each engine
at size 2 starts its rank 1 as a child process, fp32, gloo): a request prefilled at size P and decoded
at size D gives the greedy tokens of one engine at size 1, for tiny random-weight Llama (one KV head,
replicated on both ranks) and the Qwen3.5 hybrid (KV heads and Gated DeltaNet state channels split),
for P/D 1/2, 2/1 and 2/2, over tcp and shm. Each decode rank is written only its own heads; every
lease and block is free afterwards on both sides, also when a prefill rank hangs up mid-import (and
the decode side's, when one is killed). Each prefill rank serves its own share from its own process,
and each decode rank reads its own share over its own channels, in its own process, straight from the
prefill ranks holding it; no channel holds a copy of a request's blocks."""

from __future__ import annotations

import math
import os
import signal
import time

import msgspec
import pytest
import torch
from kv_transfer_helpers import SECRET, random_prompts
from tp_pd_engines import GREEDY, Engines, colocated, disaggregated
from tp_pd_engines import all_free as _all_free
from tp_pd_engines import run as _run

from splitserve.engine.engine import LLMEngine
from splitserve.engine.kv_connector import KVConnector
from splitserve.engine.kv_transfer import KVTransferFailed
from splitserve.engine.tp.kv_routes import Plan, parts
from splitserve.model.config import ModelConfig
from splitserve.model.parallel import kv_head_index
from splitserve.model.random_weights import random_source_config
from splitserve.transport import PeerRefused, TransportError
from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.layout import itemsize
from splitserve.wire.ops import FaultKnobs

PROMPTS = random_prompts((5, 37, 18), vocab=500, seed=7)


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def engines():
    made = Engines(SECRET, config=lambda size, backend: {"kv_shared_memory": backend == "shm"})
    yield made
    made.close()


def _colocated(engine: LLMEngine) -> list[list[int]]:
    return colocated(engine, PROMPTS)


def _disaggregated(p: LLMEngine, d: LLMEngine, tag: str) -> list[list[int]]:
    return disaggregated(p, d, PROMPTS, tag)


def _leases(conn: KVConnector) -> int:
    """Leases still held, on every rank's transport (each rank's, at size > 1, in its own process)."""
    info = conn.transport.describe()
    if info.tensor_parallel is not None:
        assert sum(info.tensor_parallel.leases_active) == info.leases.active
    return info.leases.active


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:qwen3.5-tiny"])
@pytest.mark.parametrize("sizes", [(1, 2), (2, 1), (2, 2)], ids=lambda s: f"P{s[0]}D{s[1]}")
def test_pd_across_tensor_parallel_sizes_equals_colocated(engines, model, sizes):
    reference = _colocated(engines.get(model, 1)[0])
    assert any(len(set(t)) > 2 for t in reference)  # not a degenerate repeat
    (p, pc), (d, dc) = engines.get(model, sizes[0]), engines.get(model, sizes[1], name="b")
    assert _disaggregated(p, d, f"{sizes}") == reference
    assert _all_free(d) and _all_free(p)
    assert _leases(pc) == 0
    if sizes[1] == 2:  # each decode rank was written its own heads only: the same bytes on both
        written = dc.transport.describe().tensor_parallel.fetched_bytes
        assert written[0] == written[1] > 0


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2), (2, 2)], ids=lambda s: f"P{s[0]}D{s[1]}")
def test_the_hybrid_over_shm(engines, sizes):
    model = "random:qwen3.5-tiny"
    reference = _colocated(engines.get(model, 1)[0])
    p, d = engines.get(model, sizes[0], "shm"), engines.get(model, sizes[1], "shm", name="b")
    assert _disaggregated(p[0], d[0], f"shm{sizes}") == reference
    assert _all_free(d[0]) and _all_free(p[0])


def test_sizes_the_model_cannot_split_are_refused_naming_both():
    cfg = ModelConfig.from_hf(random_source_config("random:tiny-llama"))
    with pytest.raises(
        PeerRefused, match="tensor_parallel_size 3 onto a decode replica at tensor_parallel_size 2"
    ):
        Plan.build(cfg, 3, 2)
    plan = Plan.build(cfg, 2, 1)  # one KV head on both prefill ranks: read once, from rank 0
    assert plan.needed == [0] and [r.src for r in plan.kv[0]] == [0]
    hybrid = ModelConfig.from_hf(random_source_config("random:qwen3.5-tiny"))
    plan = Plan.build(hybrid, 1, 2)  # each decode rank slices the one prefill rank's channels
    assert plan.needed == [0] and len(plan.states["conv"][1][0].src_pos) < hybrid.linear.conv_dim


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=lambda s: f"P{s[0]}D{s[1]}")
def test_a_probe_moves_each_head_to_the_rank_that_owns_it(engines, sizes):
    """A transport probe (what `splitserve verify` times) between the sizes: the handle names each
    prefill rank's own server and the model's KV heads it holds; random bytes in rank 0's blocks land,
    head by head, where the decode side's rank 0 owns those heads (the other ranks' pools live in their
    own processes: the byte counts of the test below cover them). The handshake check (a worker
    rejoining after a role change) finds the exporter's rank layout."""
    model = "random:qwen3.5-tiny"
    (p, pc), (d, dc) = engines.get(model, sizes[0]), engines.get(model, sizes[1], name="b")
    cfg = ModelConfig.from_hf(random_source_config(model))
    lease, into = p.lease_blocks(3), d.lease_blocks(3, touch=True)
    src = p.kv_cache[lease.block_ids] = torch.randn(p.kv_cache[lease.block_ids].shape)
    handle = pc.transport.export("probe", lease.block_ids, lease.num_tokens, lease.state)
    assert handle.tp_size == sizes[0] and len(handle.shards) == (sizes[0] if sizes[0] > 1 else 0)
    if sizes[0] > 1:
        info = pc.transport.describe().tensor_parallel
        assert [s.address for s in handle.shards] == info.addresses and len(set(info.addresses)) == 2
        assert [list(s.kv_heads) for s in handle.shards] == [kv_head_index(cfg, 2, r) for r in range(2)]
    peer = dc.check_peer(pc.transport.listen(), 5.0)
    assert peer.num_kv_heads == len(kv_head_index(cfg, sizes[0], 0)) and peer.model_fingerprint
    dc.fetch_blocks(handle, into.block_ids, 20.0)
    dc.release(handle)
    held = kv_head_index(cfg, sizes[0], 0)  # the model's heads prefill rank 0 holds
    for pos, head in enumerate(kv_head_index(cfg, sizes[1], 0)):
        if head in held:
            assert torch.equal(d.kv_cache[into.block_ids][..., pos, :], src[..., held.index(head), :])
    d.release_blocks(into)
    assert _all_free(d) and _all_free(p)


def test_a_handle_whose_ranks_hold_other_heads_is_refused_naming_both(engines):
    """A handle whose ranks say they hold other KV heads than its size puts on them is refused before
    any byte moves, naming both sizes; nothing leaks."""
    model = "random:qwen3.5-tiny"
    (p, pc), (d, dc) = engines.get(model, 2), engines.get(model, 1, name="b")
    lease, into = p.lease_blocks(2), d.lease_blocks(2, touch=True)
    handle = pc.transport.export("swapped", lease.block_ids, lease.num_tokens, lease.state)
    a, b = handle.shards
    swapped = msgspec.structs.replace(handle, shards=(a, msgspec.structs.replace(b, kv_heads=a.kv_heads)))
    with pytest.raises(PeerRefused, match="tensor_parallel_size 2 onto a decode replica at "
                       "tensor_parallel_size 1") as refused:  # fmt: skip
        dc.fetch_blocks(swapped, into.block_ids, 5.0)
    assert "prefill rank 1 serves KV heads" in refused.value.mismatches[0]
    dc.release(handle)
    d.release_blocks(into)
    assert _all_free(d) and _all_free(p) and _leases(pc) == 0


def _fetcher(conn: KVConnector):
    """The decode side's part reader: the TP transport's, or a size-1 connector's own."""
    return getattr(conn.transport, "fetcher", None) or conn.sharded


def _served(conn: KVConnector) -> tuple[list[int], list[int]]:
    """Bytes each prefill rank's server served, and the process it runs in."""
    info = conn.transport.describe()
    if info.tensor_parallel is None:
        return [int(info.counts.get("served_bytes", 0))], [os.getpid()]
    return info.tensor_parallel.served_bytes, info.tensor_parallel.served_pids


def _layout_served(plan: Plan, full, n: int) -> list[int]:  # noqa: ANN001
    """What each prefill rank serves of `n` blocks by the plan: its whole rank layout to its twin at
    one size, else the heads and state channels each decode rank's parts select of it."""
    if plan.src.size == plan.dst.size:
        return [plan.src.rank_layout(full, p).payload_nbytes(n) for p in range(plan.src.size)]
    out = [0] * plan.src.size
    head = full.block_nbytes // full.num_kv_heads
    shapes = {name: (shape, dtype) for name, shape, dtype in full.state_shapes}
    for d in range(plan.dst.size):
        for part in parts(plan, d):
            out[part.src] += n * head * sum(k for _, k in part.select.heads)
            for name, axis, runs in part.select.states:
                shape, dtype = shapes[name]
                per = itemsize(dtype) * math.prod(shape) // shape[axis]
                out[part.src] += per * sum(k for _, k in runs)
    return out


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("model", ["random:tiny-llama", "random:qwen3.5-tiny"])
@pytest.mark.parametrize("sizes", [(2, 1), (1, 2), (2, 2)], ids=lambda s: f"P{s[0]}D{s[1]}")
def test_each_rank_serves_and_reads_its_own_share_in_its_own_process(engines, backend, model, sizes):
    """Across sizes each decode rank reads, over channels of its own, exactly its rank layout's bytes
    (its KV heads and state channels), from the prefill ranks holding them; each prefill rank serves,
    from its own process, exactly what the layout puts on it and the decode ranks read of it; no
    channel of the decode side holds a request's blocks (one unused block each); each decode rank's
    reads ran in that rank's process."""
    (p, pc), (d, dc) = engines.get(model, sizes[0], backend), engines.get(model, sizes[1], backend, "b")
    cfg = ModelConfig.from_hf(random_source_config(model))
    fetcher, n = _fetcher(dc), 3
    before_parts, (before_served, _) = fetcher.rank_parts(), _served(pc)
    lease, into = p.lease_blocks(n), d.lease_blocks(n, touch=True)
    handle = pc.transport.export("share", lease.block_ids, lease.num_tokens, lease.state)
    dc.fetch_blocks(handle, into.block_ids, 20.0)
    dc.release(handle)
    d.release_blocks(into)
    after = fetcher.rank_parts()
    read = [a.fetched_bytes - b.fetched_bytes for a, b in zip(after, before_parts, strict=True)]
    plan = Plan.build(cfg, *sizes)
    owned = [plan.dst.rank_layout(dc.layout, r).payload_nbytes(n) for r in range(sizes[1])]
    assert read == owned
    after_served, serving = _served(pc)
    served = [a - b for a, b in zip(after_served, before_served, strict=True)]
    assert served == _layout_served(plan, pc.layout, n)
    # each prefill rank served from its own process: rank 0 from the engine's, rank r from its own
    assert serving == [os.getpid()] + ([proc.pid for proc in p.runner.ranks.procs] if sizes[0] > 1 else [])
    from_rank = [0] * sizes[0]  # what the decode ranks' channels say they read of each prefill rank
    for a, b in zip(after, before_parts, strict=True):
        for q in range(sizes[0]):
            from_rank[q] += a.by_prefill_rank.get(q, 0) - b.by_prefill_rank.get(q, 0)
    assert served == from_rank and sum(served) == sum(owned)
    assert all(t.kv_cache.shape[0] == 1 for t in fetcher.peers.values())
    # each decode rank read in its own process: rank 0 in the engine's, rank r in its rank process
    pids = [os.getpid()] + ([proc.pid for proc in d.runner.ranks.procs] if sizes[1] > 1 else [])
    assert [a.pid for a in after] == pids
    assert _all_free(d) and _all_free(p) and _leases(pc) == 0


@pytest.mark.parametrize("sizes", [(2, 1), (1, 2)], ids=lambda s: f"P{s[0]}D{s[1]}")
def test_a_prefill_rank_that_hangs_up_fails_the_fetch_and_every_lease_ends(engines, sizes):
    """A prefill rank hangs up on every fetch: prefill rank 1 of 2 (decode at 1: half the heads come
    from it), or the one prefill rank of a size-1 replica (decode at 2: both decode ranks' reads fail,
    rank 1's in its own process). The import fails with a transport error, the connector releases every
    rank's lease, and the blocks come back on both sides; with the fault gone, the next import
    succeeds."""
    model = "random:qwen3.5-tiny"
    (p, pc), (d, _) = engines.get(model, sizes[0]), engines.get(model, sizes[1], name="b")
    reference = _colocated(engines.get(model, 1)[0])
    faulty = pc.transport.ranks[1] if sizes[0] == 2 else pc.transport
    faulty.install_faults(FaultPlan(FaultKnobs(kill=1.0)))
    try:
        p.add_request(PROMPTS[0], GREEDY, request_id=f"hangup-p{sizes}", kv_transfer="export")
        out = _run(p)[f"hangup-p{sizes}"]
        with pytest.raises(KVTransferFailed) as failed:
            d.add_request_with_kv(
                out.kv_export.handle, PROMPTS[0], out.outputs[0].token_ids[0], GREEDY, f"hangup{sizes}"
            )
        assert isinstance(failed.value.cause, TransportError)
    finally:
        faulty.install_faults(None)
    assert _all_free(d) and _all_free(p) and _leases(pc) == 0
    assert _disaggregated(p, d, f"after-hangup{sizes}")[0] == reference[0]


def test_a_killed_prefill_rank_fails_the_import_and_the_decode_side_frees_everything(engines):
    """Prefill rank 1 of 2 is killed (SIGKILL) after an export: the server of its heads went with its
    process. The decode side's import fails with a transport error well within its deadline, and every
    block and state slot of the decode side is free; the prefill replica is down (its rank watcher
    marks it dead)."""
    model = "random:qwen3.5-tiny"
    (p, _), (d, _) = engines.get(model, 2, name="killed"), engines.get(model, 1, name="b")
    p.add_request(PROMPTS[1], GREEDY, request_id="killed-p", kv_transfer="export")
    out = _run(p)["killed-p"]
    rank1 = p.runner.ranks.procs[0]
    os.kill(rank1.pid, signal.SIGKILL)
    rank1.wait()
    start = time.monotonic()
    with pytest.raises(KVTransferFailed) as failed:
        d.add_request_with_kv(out.kv_export.handle, PROMPTS[1], out.outputs[0].token_ids[0], GREEDY, "killed")
    assert isinstance(failed.value.cause, TransportError)
    assert time.monotonic() - start < 10
    assert _all_free(d)
    deadline = time.monotonic() + 5
    while p.runner.ranks.dead is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert p.runner.ranks.dead is not None and f"pid {rank1.pid}" in p.runner.ranks.dead
