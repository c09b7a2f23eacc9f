"""Per-request block bookkeeping over the `BlockPool`: prefix hits, growth, caching of full blocks."""

from __future__ import annotations

from typing import Any

from splitserve.engine.block_pool import ROOT_HASH, BlockPool, hash_block
from splitserve.engine.request import Request
from splitserve.engine.state_pool import StatePool


class KVManager:
    """Owns a request's blocks and, for hybrid models, its recurrent-state slot."""

    def __init__(self, pool: BlockPool, block_size: int, states: StatePool | None = None) -> None:
        self.pool = pool
        self.block_size = block_size
        self.states = states if states is not None and states.enabled else None

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, req: Request) -> list[int]:
        """Cached blocks covering the request's leading tokens; at least one token is left to compute."""
        if not self.pool.enable_prefix_caching:
            return []
        self._extend_hashes(req, req.num_tokens)
        max_blocks = (req.num_tokens - 1) // self.block_size
        return self.pool.lookup(req.block_hashes[:max_blocks])

    def allocate(self, req: Request, num_new_tokens: int, prefix_blocks: list[int] | None = None) -> bool:
        """Make room for `num_new_tokens` more computed tokens; False (and no change) if the pool is short."""
        if not prefix_blocks and (self.states is None or req.state_slot is not None):
            # the common case (a running decode inside its last block): nothing to do
            if req.num_computed_tokens + num_new_tokens <= len(req.block_ids) * self.block_size:
                return True
        prefix_blocks = prefix_blocks or []
        have = len(req.block_ids) + len(prefix_blocks)
        computed = req.num_computed_tokens + len(prefix_blocks) * self.block_size
        need = self.blocks_for(computed + num_new_tokens) - have
        # Blocks found in the cache with ref 0 sit in the free queue: touching them uses up free slots.
        reclaimed = sum(1 for b in prefix_blocks if self.pool.ref_counts[b] == 0)
        if need + reclaimed > self.pool.num_free:
            return False
        if self.states is not None and req.state_slot is None:
            req.state_slot = self.states.allocate()
            if req.state_slot is None:
                return False
        if prefix_blocks:
            self.pool.touch(prefix_blocks)
            req.block_ids.extend(prefix_blocks)
        if need > 0:
            req.block_ids.extend(self.pool.allocate(need))
        return True

    def free(self, req: Request, after: Any = None) -> None:
        """Give back the request's blocks (once `after`, a CUDA event, has happened: see
        `BlockPool.free_after`) and its state slot (likewise)."""
        if after is not None:
            self.pool.free_after(req.block_ids, after)
        else:
            self.pool.free(req.block_ids)
        req.block_ids = []
        req.num_cached_blocks = 0
        if req.state_slot is not None and self.states is not None:
            if after is not None:
                self.states.free_after(req.state_slot, after)
            else:
                self.states.free(req.state_slot)
            req.state_slot = None

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks whose KV is now complete under their content hash."""
        if not self.pool.enable_prefix_caching:
            return
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if full <= req.num_cached_blocks:
            return
        self._extend_hashes(req, full * self.block_size)
        for i in range(req.num_cached_blocks, full):  # NOTE: only blocks that became full since last time
            self.pool.cache(req.block_ids[i], req.block_hashes[i])
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        bs = self.block_size
        while (len(req.block_hashes) + 1) * bs <= num_tokens:
            i = len(req.block_hashes)
            parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
            req.block_hashes.append(hash_block(parent, req.token_ids(i * bs, (i + 1) * bs)))
