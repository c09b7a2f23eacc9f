"""BlockPool and BlockManager without a model: ref counts, the prefix cache by content hash, and the
eviction order of the free queue (least recently freed first; never-used blocks before freed ones;
a request's tail blocks before its head blocks)."""

from __future__ import annotations

import pytest

from splitserve.engine.block_manager import BlockManager
from splitserve.engine.block_pool import ROOT_HASH, BlockPool, NoFreeBlocks, hash_block
from splitserve.engine.request import Request
from splitserve.sampling.params import SamplingParams


def _hashes(token_ids: list[int], block_size: int) -> list[bytes]:
    out, parent = [], ROOT_HASH
    for i in range(len(token_ids) // block_size):
        parent = hash_block(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def _free_order(pool: BlockPool) -> list[int]:
    return list(pool._free)


def _request(rid: str, prompt: list[int], max_tokens: int = 8) -> Request:
    return Request(rid, list(prompt), SamplingParams(max_tokens=max_tokens), (), max_tokens)


def test_hash_covers_the_whole_prefix():
    a = hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a == hash_block(ROOT_HASH, [1, 2, 3, 4])
    assert a != hash_block(ROOT_HASH, [1, 2, 3, 5])
    # the same block content after a different parent is a different block
    assert hash_block(a, [5, 6, 7, 8]) != hash_block(hash_block(ROOT_HASH, [0, 2, 3, 4]), [5, 6, 7, 8])


def test_allocate_and_free_ref_counts():
    pool = BlockPool(4)
    assert pool.num_free == 4 and pool.usage == 0.0
    a = pool.allocate(3)
    assert a == [0, 1, 2]  # a fresh pool hands out blocks in order
    assert [pool.ref_counts[b] for b in a] == [1, 1, 1]
    assert pool.num_free == 1 and pool.usage == 0.75
    with pytest.raises(NoFreeBlocks):
        pool.allocate(2)
    assert pool.num_free == 1  # a failed allocation changes nothing
    pool.free(a)
    assert pool.num_free == 4 and pool.ref_counts == [0, 0, 0, 0]


def test_empty_pool_is_rejected():
    with pytest.raises(ValueError, match="KV"):
        BlockPool(0)


def test_double_free_asserts():
    pool = BlockPool(2)
    blocks = pool.allocate(1)
    pool.free(blocks)
    with pytest.raises(AssertionError, match="freed twice"):
        pool.free(blocks)


def test_prefix_lookup_by_content_hash():
    pool = BlockPool(8)
    tokens = list(range(100, 112))  # 3 blocks of 4
    h = _hashes(tokens, 4)
    blocks = pool.allocate(3)
    for b, hb in zip(blocks, h, strict=True):
        pool.cache(b, hb)
    assert pool.block_hash[blocks[0]] == h[0]
    # the longest run from the start; a miss ends it even if later blocks are cached
    assert pool.lookup(h) == blocks
    assert pool.lookup(h[:2]) == blocks[:2]
    other = _hashes([100, 101, 102, 999] + tokens[4:], 4)
    assert pool.lookup(other) == []
    assert pool.hits == 5 and pool.queries == 3 + 2 + 3
    # lookup takes no reference: only touch does
    assert [pool.ref_counts[b] for b in blocks] == [1, 1, 1]
    pool.touch(blocks[:2])
    assert [pool.ref_counts[b] for b in blocks] == [2, 2, 1]
    pool.free(blocks[:2])
    pool.free(blocks)
    assert pool.num_free == 8 and all(r == 0 for r in pool.ref_counts)
    # freed blocks keep their hash and stay findable
    assert pool.lookup(h) == blocks


def test_same_content_cached_twice_keeps_the_first_copy():
    pool = BlockPool(4)
    h = hash_block(ROOT_HASH, [1, 2])
    a, b = pool.allocate(2)
    pool.cache(a, h)
    pool.cache(b, h)
    assert pool.block_hash[b] is None
    assert pool.lookup([h]) == [a]
    pool.cache(a, hash_block(ROOT_HASH, [3, 4]))  # a block's hash is set once
    assert pool.block_hash[a] == h


def test_touch_of_a_cached_free_block_takes_it_off_the_free_queue():
    pool = BlockPool(4)
    h = _hashes([1, 2, 3, 4, 5, 6, 7, 8], 4)
    blocks = pool.allocate(2)
    for b, hb in zip(blocks, h, strict=True):
        pool.cache(b, hb)
    pool.free(blocks)
    assert pool.num_free == 4
    hit = pool.lookup(h)
    pool.touch(hit)
    assert pool.num_free == 2 and [pool.ref_counts[b] for b in hit] == [1, 1]
    assert set(_free_order(pool)).isdisjoint(hit)
    assert sorted(pool.allocate(2)) == [2, 3]  # the touched blocks are not handed out
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    # freed again, they go to the back of the queue (most recently used)
    pool.free(hit)
    assert _free_order(pool) == [1, 0]


def test_eviction_order_is_lru_with_never_used_blocks_first():
    pool = BlockPool(6)
    tokens = list(range(12))
    h = _hashes(tokens, 4)
    req_blocks = pool.allocate(3)  # [0, 1, 2]
    for b, hb in zip(req_blocks, h, strict=True):
        pool.cache(b, hb)
    pool.free(req_blocks)
    # never-used blocks first, then the freed request's blocks tail first (heads are more shareable)
    assert _free_order(pool) == [3, 4, 5, 2, 1, 0]
    assert pool.allocate(3) == [3, 4, 5]  # the cached blocks survive while uncached ones remain
    assert pool.lookup(h) == [0, 1, 2]
    # the next allocation evicts the tail block: its hash is dropped, the head stays findable
    assert pool.allocate(1) == [2]
    assert pool.block_hash[2] is None
    assert pool.lookup(h) == [0, 1]
    # ordering is by time of freeing, cached or not: a block freed later is evicted later
    pool.free([3])  # uncached, freed after 0 and 1
    assert _free_order(pool) == [1, 0, 3]
    assert pool.allocate(2) == [1, 0]
    assert pool.lookup(h) == []
    assert pool.allocate(1) == [3]


def test_reset_prefix_cache_and_disabled_caching():
    pool = BlockPool(2)
    h = hash_block(ROOT_HASH, [1])
    (b,) = pool.allocate(1)
    pool.cache(b, h)
    pool.reset_prefix_cache()
    assert pool.lookup([h]) == [] and pool.block_hash[b] is None

    off = BlockPool(2, enable_prefix_caching=False)
    (b,) = off.allocate(1)
    off.cache(b, h)
    assert off.block_hash[b] is None and off.lookup([h]) == []


# ---- BlockManager ------------------------------------------------------------------------------------


def test_block_manager_prefix_leaves_one_token_to_compute():
    pool = BlockPool(8)
    block_manager = BlockManager(pool, block_size=4)
    prompt = list(range(1, 9))  # exactly 2 blocks
    first = _request("a", prompt)
    assert block_manager.find_prefix(first) == []
    assert block_manager.allocate(first, len(prompt))
    first.num_computed_tokens = len(prompt)
    block_manager.cache_full_blocks(first)
    assert [pool.block_hash[b] for b in first.block_ids] == _hashes(prompt, 4)
    block_manager.free(first)
    assert first.block_ids == [] and pool.num_free == 8

    # same 8 tokens: only the first block may be reused, the last token must be computed
    same = _request("b", prompt)
    hit = block_manager.find_prefix(same)
    assert hit == [0]
    # a longer prompt with the same start reuses both blocks
    longer = _request("c", [*prompt, 50, 51])
    assert block_manager.find_prefix(longer) == [0, 1]


def test_block_manager_allocate_counts_reclaimed_cached_blocks():
    pool = BlockPool(3)
    block_manager = BlockManager(pool, block_size=4)
    prompt = list(range(1, 9))
    a = _request("a", prompt)
    assert block_manager.allocate(a, 8)
    a.num_computed_tokens = 8
    block_manager.cache_full_blocks(a)
    block_manager.free(a)

    b = _request("b", [*prompt, 9, 10, 11, 12, 13])  # 13 tokens: 2 cached blocks + 2 new ones
    prefix = block_manager.find_prefix(b)
    assert prefix == [0, 1]
    # the cached blocks are free (ref 0): reusing them plus 2 more needs 4 blocks; there are 3
    assert not block_manager.allocate(b, 5, prefix)
    assert b.block_ids == [] and pool.num_free == 3 and pool.ref_counts == [0, 0, 0]
    # one new block's worth fits
    assert block_manager.allocate(b, 4, prefix)
    assert b.block_ids[:2] == [0, 1] and len(b.block_ids) == 3
    assert pool.ref_counts == [1, 1, 1] and pool.num_free == 0
    block_manager.free(b)
    assert pool.num_free == 3 and pool.ref_counts == [0, 0, 0]


def test_block_manager_grows_one_block_at_a_time():
    pool = BlockPool(4)
    block_manager = BlockManager(pool, block_size=4)
    r = _request("a", [1, 2, 3])
    assert block_manager.allocate(r, 3) and len(r.block_ids) == 1
    r.num_computed_tokens = 3
    assert block_manager.allocate(r, 1) and len(r.block_ids) == 1  # position 3 still fits block 0
    r.num_computed_tokens = 4
    assert block_manager.allocate(r, 1) and len(r.block_ids) == 2
    block_manager.free(r)
    assert pool.num_free == 4


def test_blocks_freed_after_a_late_copy_come_back_only_once_it_has_ended():
    class Copy:  # a stand-in for the CUDA event after a copy still writing the blocks (no GPU here)
        ended = False

        def query(self) -> bool:
            return self.ended

    pool = BlockPool(4)
    a, b = pool.allocate(2), pool.allocate(2)
    copy = Copy()
    pool.free_after(a, copy)
    assert pool.num_free == 0 and pool.num_held == 2
    with pytest.raises(NoFreeBlocks):
        pool.allocate(1)
    pool.free(b)
    assert sorted(pool.allocate(2)) == sorted(b)  # never the held ones
    copy.ended = True
    assert pool.num_held == 0 and pool.num_free == 2 and sorted(pool.allocate(2)) == sorted(a)


# ---- blocks without the MTP head's K/V ---------------------------------------------------------------


def test_a_headless_copy_gives_way_to_one_with_the_head_and_leaves_with_the_cache():
    pool = BlockPool(4)
    h = _hashes(list(range(8)), 4)
    a, b, c, d = pool.allocate(4)
    pool.cache_blocks([a, b], h, headless=True)
    assert pool.lookup(h) == [a, b] and pool.headless == {a, b}
    pool.cache_blocks([c], h[:1], headless=True)  # another copy without the head: the first stays
    assert pool.lookup(h[:1]) == [a] and pool.block_hash[c] is None
    pool.cache_blocks([d], h[:1])  # a copy with the head's K/V takes the hash
    assert pool.lookup(h) == [d, b] and pool.headless == {b}
    assert pool.block_hash[a] is None
    pool.free([a, b, c])
    pool.free([d])
    assert sorted(pool.allocate(3)) == [a, b, c]  # b handed out again: it left the cache
    assert pool.headless == set() and pool.lookup(h) == [d]
    pool.cache_blocks([a], [hash_block(ROOT_HASH, [9])], headless=True)
    pool.reset_prefix_cache()
    assert pool.headless == set()


class _Head:
    """The MTP back-off's side of the block manager, as spec/verify.py's SpecDecoder answers it."""

    def __init__(self, needs: bool) -> None:
        self.needs, self.lost = needs, []

    def needs_head(self, req: Request) -> bool:
        return self.needs

    def lose_head(self, req: Request) -> None:
        self.lost.append(req.request_id)
        req.head_lost = True


@pytest.mark.parametrize("needs", [True, False], ids=["drafts", "does-not-draft"])
def test_a_hit_on_headless_blocks_stops_before_them_or_loses_the_head(needs):
    pool = BlockPool(8)
    block_manager = BlockManager(pool, block_size=4)
    block_manager.head = head = _Head(needs)
    prompt = list(range(1, 14))  # three whole blocks and a token
    first = _request("a", prompt)
    assert block_manager.allocate(first, 8)
    first.num_computed_tokens = 8
    block_manager.cache_full_blocks(first)  # two blocks with the head's K/V
    first.head_lost = True
    assert block_manager.allocate(first, 4)
    first.num_computed_tokens = 12
    block_manager.cache_full_blocks(first)  # the third without
    assert pool.headless == {first.block_ids[2]}
    later = _request("b", prompt)
    hit = block_manager.find_prefix(later)
    assert hit == (first.block_ids[:2] if needs else first.block_ids[:3])
    assert head.lost == ([] if needs else ["b"]) and later.head_lost is not needs
    if needs:  # it computes the third block itself, with the head: its copy replaces the cached one
        assert block_manager.allocate(later, 5, hit)
        later.num_computed_tokens = 12
        block_manager.cache_full_blocks(later)
        assert pool.headless == set() and pool.lookup(later.block_hashes[:3]) == later.block_ids[:3]
