"""The KV block pool: reference-counted blocks, an LRU free queue, and a prefix cache by content hash.

A block's hash covers its tokens and, through the parent hash, every token before it, so equal hashes
mean equal KV. A freed block keeps its hash and stays findable until the pool hands it out again:
the free queue is in eviction order (least recently freed first; a request's tail blocks before its
head blocks, since heads are the more shareable).

With an MTP head (engine/spec/mtp.py) the head's K/V sit in the blocks too, and a block computed while
the head was backed off holds none: `headless` names the cached blocks of that kind (at most every
block of the pool), so that a request that drafts can be kept off them. A block leaves it when it
leaves the cache (handed out again, or the cache reset), or when a copy with the head's K/V is
computed and takes its place under the hash.

NOTE: invariant: a block is in the free queue exactly when its ref_count is 0.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

# NOTE: one hash chain for the engine and the router (which looks prompts up in its view of each
# replica's cache): the function lives on the wire both import.
from splitserve.wire.kv_events import ROOT_HASH as ROOT_HASH
from splitserve.wire.kv_events import extend_chain as extend_chain
from splitserve.wire.kv_events import hash_block as hash_block

if TYPE_CHECKING:
    from splitserve.engine.kv_events import KVEventLog


class NoFreeBlocks(RuntimeError):
    pass


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        if num_blocks < 1:
            raise ValueError("the KV cache has no room for a single block; raise the KV memory budget")
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_counts = [0] * num_blocks
        self.block_hash: list[bytes | None] = [None] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[bytes, int] = {}
        self.headless: set[int] = set()  # cached blocks without the MTP head's K/V (module docstring)
        self._held: list[tuple[list[int], Any]] = []  # freed, but still written by a late copy
        # blocks [fresh_from, num_blocks) were never handed out: the free queue starts with them in order
        self.fresh_from = 0
        self.hits = 0
        self.queries = 0
        self.events: KVEventLog | None = None  # what cache-aware routers follow (kv_events.py)

    @property
    def num_free(self) -> int:
        self._reclaim()
        return len(self._free)

    @property
    def num_held(self) -> int:
        """Blocks freed while a copy was still writing them (`free_after`), not yet back."""
        self._reclaim()
        return sum(len(ids) for ids, _ in self._held)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free / self.num_blocks

    def allocate(self, n: int) -> list[int]:
        self._reclaim()
        if n > len(self._free):
            raise NoFreeBlocks(f"need {n} blocks, {len(self._free)} free")
        pop = self._free.popitem
        out = [pop(last=False)[0] for _ in range(n)]
        hashes, refs = self.block_hash, self.ref_counts
        for block in out:
            if hashes[block] is not None:  # a cached block handed out again: it leaves the cache
                self._evict(block)
            refs[block] = 1
        if out:
            self.fresh_from = max(self.fresh_from, max(out) + 1)
        return out

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference to each block; tail blocks become the first to evict."""
        for block in reversed(block_ids):
            self.ref_counts[block] -= 1
            assert self.ref_counts[block] >= 0, f"block {block} freed twice"
            if self.ref_counts[block] == 0:
                self._free[block] = None

    def free_after(self, block_ids: Sequence[int], done: Any) -> None:
        """`free(block_ids)` once `done.query()` is true (the CUDA event after a copy that may still
        write them: a KV fetch that failed or ran past its deadline): until then they stay out of
        the free list, so no request is given blocks that a late copy could still overwrite."""
        self._held.append((list(block_ids), done))

    def _reclaim(self) -> None:
        if self._held:
            held, self._held = self._held, []
            for ids, done in held:
                if done.query():
                    self.free(ids)
                else:
                    self._held.append((ids, done))

    def lookup(self, hashes: Sequence[bytes]) -> list[int]:
        """The longest run of cached blocks matching `hashes` from the start (not yet referenced)."""
        if not self.enable_prefix_caching:
            return []
        hits = []
        for h in hashes:
            block = self._cached.get(h)
            if block is None:
                break
            hits.append(block)
        self.queries += len(hashes)
        self.hits += len(hits)
        return hits

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take a reference to cached blocks found by `lookup`."""
        for block in block_ids:
            if self.ref_counts[block] == 0:
                del self._free[block]
            self.ref_counts[block] += 1

    def cache(self, block: int, block_hash: bytes) -> None:
        self.cache_blocks([block], [block_hash])

    def cache_blocks(
        self, blocks: Sequence[int], block_hashes: Sequence[bytes], headless: bool = False
    ) -> None:
        """Make each block findable under its hash (in order; a block or a hash cached already is
        left as it is: the same content computed twice keeps its first copy, unless that copy is
        `headless` and this one is not: then this one takes its place). `headless`: the blocks hold
        no MTP head K/V (computed while the head was backed off)."""
        if not self.enable_prefix_caching:
            return
        hashes, cached, events = self.block_hash, self._cached, self.events
        for block, block_hash in zip(blocks, block_hashes, strict=True):
            if hashes[block] is not None:
                continue
            old = cached.get(block_hash)
            if old is not None:
                if headless or old not in self.headless:
                    continue
                # the old copy stays with the requests that hold it, findable no more (the hash
                # itself stays cached: no event)
                hashes[old] = None
                self.headless.discard(old)
            elif events is not None:
                events.record("stored", block_hash)
            hashes[block] = block_hash
            cached[block_hash] = block
            if headless:
                self.headless.add(block)

    def reset_prefix_cache(self) -> None:
        for block in list(self._cached.values()):
            self.block_hash[block] = None
        self._cached.clear()
        self.headless.clear()
        if self.events is not None:
            self.events.record("cleared", None)

    def _evict(self, block: int) -> None:
        h = self.block_hash[block]
        if h is not None:
            self.block_hash[block] = None
            self.headless.discard(block)
            if self._cached.get(h) == block:
                del self._cached[h]
                if self.events is not None:
                    self.events.record("removed", h)
