"""The prefix cache's event log without a model: what the block pool and the state checkpoints record
as blocks become findable and are evicted, merged and numbered per drain, and the block hash chain the
router computes from token ids, equal to the engine's."""

from __future__ import annotations

import hashlib

import numpy as np
import torch

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.block_pool import BlockPool
from splitserve.engine.kv_events import KVEventLog
from splitserve.engine.request import Request
from splitserve.engine.state_cache import StateCheckpoints
from splitserve.sampling.params import SamplingParams
from splitserve.wire.kv_events import ROOT_HASH, block_hashes, extend_chain, hash_block


def test_the_router_computes_the_engines_hash_chain():
    prompt = [int(x) for x in np.random.default_rng(0).integers(0, 150_000, 40)]
    pool = BlockPool(8)
    manager = BlockManager(pool, block_size=8)
    req = Request("a", prompt, SamplingParams(max_tokens=1), (), 1)
    assert manager.allocate(req, len(prompt))
    req.num_computed_tokens = len(prompt)
    manager.cache_full_blocks(req)
    assert [pool.block_hash[b] for b in req.block_ids] == block_hashes(prompt, 8)
    # the bytes hashed: the parent's hash, then the ids as little-endian int64
    data = ROOT_HASH + np.asarray(prompt[:8], dtype="<i8").tobytes()
    assert hash_block(ROOT_HASH, prompt[:8]) == hashlib.blake2b(data, digest_size=16).digest()


def test_the_chain_hashes_block_by_block_from_any_parent():
    ids = [int(x) for x in np.random.default_rng(1).integers(0, 250_000, 8 * 5 + 3)]
    parent, expected = b"p" * 16, []
    for i in range(5):  # the 3 trailing ids make no whole block
        parent = hash_block(parent, ids[i * 8 : (i + 1) * 8])
        expected.append(parent)
    assert extend_chain(b"p" * 16, ids, 8) == expected
    assert block_hashes(ids, 8, max_blocks=2) == extend_chain(ROOT_HASH, ids[:16], 8)
    assert extend_chain(ROOT_HASH, ids[:7], 8) == []


def test_pool_records_stored_removed_and_cleared_merged_by_kind():
    pool, log = BlockPool(2), KVEventLog()
    pool.events = log
    a, b = pool.allocate(2)
    pool.cache(a, b"h1")
    pool.cache(b, b"h2")
    pool.cache(b, b"h2")  # cached already: no event
    pool.free([a, b])
    (c,) = pool.allocate(1)  # reuses the tail block first: h2 is evicted
    pool.cache(c, b"h3")
    pool.reset_prefix_cache()
    events = log.drain()
    assert [(e.seq, e.kind, e.hashes) for e in events] == [
        (1, "stored", [b"h1", b"h2"]), (2, "removed", [b"h2"]), (3, "stored", [b"h3"]), (4, "cleared", []),
    ]  # fmt: skip
    assert log.drain() == [] and log.seq == 4


def test_checkpoints_record_saved_and_evicted_entries():
    ckpt, log = (
        StateCheckpoints({"s": ((2,), torch.float32)}, 2, torch.device("cpu")),
        KVEventLog(hybrid=True),
    )
    ckpt.events = log
    states = {"s": torch.zeros(1, 2)}
    for h in (b"x", b"y", b"x", b"z"):  # x saved again: no event; z evicts the oldest entry (y)
        ckpt.save(h, states, 0)
    assert [(e.kind, e.hashes) for e in log.drain()] == [
        ("checkpoint_stored", [b"x", b"y"]), ("checkpoint_removed", [b"y"]), ("checkpoint_stored", [b"z"]),
    ]  # fmt: skip
