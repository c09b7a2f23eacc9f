"""engine/kv_prefault.py writes only blocks the pool has never handed out, in the order it hands them
out, up to its limit ahead of the pool's use; the pool tracks where its never-used blocks start."""

from __future__ import annotations

import torch

from splitserve.engine.block_pool import BlockPool
from splitserve.engine.kv_prefault import KVPrefault


def test_pool_hands_out_never_used_blocks_first_and_tracks_them() -> None:
    pool = BlockPool(10)
    first = pool.allocate(3)
    assert first == [0, 1, 2] and pool.fresh_from == 3
    pool.free(first)
    assert pool.allocate(2) == [3, 4] and pool.fresh_from == 5  # never-used blocks before freed ones


def test_prefault_writes_only_never_used_blocks_up_to_its_limit() -> None:
    pool = BlockPool(12)
    kv = torch.full((12, 2, 2, 4, 1, 8), 7.0)  # [blocks, layers, k/v, block_size, heads, dim]
    block_bytes = kv[0].numel() * kv.element_size()
    prefault = KVPrefault(kv, pool, limit_bytes=4 * block_bytes)
    used = pool.allocate(3)
    kv[used] = 1.0  # a request's KV
    while prefault.advance():
        pass
    assert (kv[used] == 1.0).all()  # in use: untouched
    assert (kv[3:7] == 0).all()  # the next four the pool will hand out
    assert (kv[7:] == 7.0).all()  # beyond the limit
    assert pool.allocate(2) == [3, 4]
    assert prefault.advance() is False  # two more blocks fit within the limit: done in one turn
    assert (kv[7:9] == 0).all() and (kv[9:] == 7.0).all()


def test_prefault_is_off_at_zero_and_stops_at_the_pool_end() -> None:
    pool = BlockPool(3)
    kv = torch.full((3, 1, 2, 4, 1, 8), 7.0)
    assert KVPrefault(kv, pool, limit_bytes=0).advance() is False and (kv == 7.0).all()
    prefault = KVPrefault(kv, pool, limit_bytes=1 << 30)
    while prefault.advance():
        pass
    assert (kv == 0).all() and prefault.advance() is False
