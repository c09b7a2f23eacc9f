"""Per-request block bookkeeping over the `BlockPool`: prefix hits, growth, caching of full blocks; for
hybrid models also the state slot and the recurrent-state checkpoints of prefix caching (state_cache.py).

With the MTP head (spec/mtp.py) a cached block may hold no head K/V (`BlockPool.headless`: computed
while the head was backed off, spec/verify.py). `head` (the engine's `SpecDecoder`) decides what a
prefix hit on such blocks means: a request that needs the head's context (it may draft, or it exports
its KV to a decode engine that may) is offered the cached prefix only up to the first of them, and
computes the rest with the head, its copies taking their place in the cache; any other request takes
the whole hit and loses its head context (`Request.head_lost`), which it would not use anyway.
"""

from __future__ import annotations

from typing import Any, Protocol

from splitserve.engine.block_pool import ROOT_HASH, BlockPool, extend_chain
from splitserve.engine.request import Request
from splitserve.engine.state_cache import StateCheckpoints
from splitserve.engine.state_pool import StatePool


class HeadContext(Protocol):
    """What the MTP head's back-off (spec/verify.py `SpecDecoder`) tells the block manager."""

    def needs_head(self, req: Request) -> bool:
        """Whether `req` must find the head's K/V over the prefix it reuses."""
        ...

    def lose_head(self, req: Request) -> None:
        """`req` reuses blocks without the head's K/V: it never drafts with the head."""
        ...


class BlockManager:
    """Owns a request's blocks and, for hybrid models, its recurrent-state slot."""

    def __init__(
        self,
        pool: BlockPool,
        block_size: int,
        states: StatePool | None = None,
        checkpoints: StateCheckpoints | None = None,
    ) -> None:
        self.pool = pool
        self.block_size = block_size
        self.states = states if states is not None and states.enabled else None
        self.checkpoints = checkpoints if checkpoints is not None and checkpoints.enabled else None
        self.head: HeadContext | None = None  # the MTP head's back-off, when it drafts (module docstring)

    def blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def find_prefix(self, req: Request) -> list[int]:
        """Cached blocks covering the request's leading tokens; at least one token is left to compute."""
        if not self.pool.enable_prefix_caching:
            return []
        self._extend_hashes(req, req.num_tokens)
        max_blocks = (req.num_tokens - 1) // self.block_size
        blocks = self.pool.lookup(req.block_hashes[:max_blocks])
        headless = self.pool.headless
        if headless and self.head is not None and self.head.needs_head(req):
            blocks = next((blocks[:i] for i, b in enumerate(blocks) if b in headless), blocks)
        if self.states is not None:
            blocks = self._state_prefix(req, blocks)
        if headless and self.head is not None and any(b in headless for b in blocks):
            self.head.lose_head(req)
        return blocks

    def _state_prefix(self, req: Request, blocks: list[int]) -> list[int]:
        """Hybrid: the KV hit cut back to its longest part that ends at a state checkpoint (restored
        into the slot by `allocate`); where the KV hit reaches further, the request's prefill stops
        there to checkpoint the shared prefix (`chunk_tokens`, `cache_full_blocks`)."""
        n = len(blocks)
        ckpt = self.checkpoints
        while n and (ckpt is None or req.block_hashes[n - 1] not in ckpt):
            n -= 1
        req.restore_hash = req.block_hashes[n - 1] if n else None
        req.checkpoint_at = len(blocks) * self.block_size if ckpt is not None and len(blocks) > n else None
        return blocks[:n]

    def chunk_tokens(self, req: Request, start: int, n: int) -> int:
        """`n` tokens from `start`, or fewer so that the chunk ends at the request's checkpoint."""
        at = req.checkpoint_at
        return at - start if at is not None and start < at < start + n else n

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
            if self.checkpoints is not None and self.states is not None and req.restore_hash is not None:
                self.checkpoints.restore(req.restore_hash, self.states.states, req.state_slot)
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

    def trim(self, req: Request) -> None:
        """Give back the blocks past the request's known tokens (speculative decoding: those that
        only rejected drafts used; never cached, since only computed tokens' blocks are)."""
        keep = max(self.blocks_for(req.num_tokens), req.num_cached_blocks)
        if len(req.block_ids) > keep:
            self.pool.free(req.block_ids[keep:])
            del req.block_ids[keep:]

    def cache_full_blocks(self, req: Request) -> None:
        """Register the blocks whose KV is now complete under their content hash."""
        if not self.pool.enable_prefix_caching:
            return
        if req.checkpoint_at is not None and req.num_computed_tokens == req.checkpoint_at:
            self._checkpoint(req)
        full = min(req.num_computed_tokens // self.block_size, len(req.block_ids))
        if full <= req.num_cached_blocks:
            return
        self._extend_hashes(req, full * self.block_size)
        # NOTE: only blocks that became full since last time
        # a request without its head context leaves blocks without the head's K/V (module docstring)
        self.pool.cache_blocks(req.block_ids[req.num_cached_blocks : full],
                               req.block_hashes[req.num_cached_blocks : full], req.head_lost)  # fmt: skip
        req.num_cached_blocks = max(req.num_cached_blocks, full)

    def _checkpoint(self, req: Request) -> None:
        """Save the state of a request that has just computed up to its checkpoint (a block boundary)."""
        at, req.checkpoint_at = req.checkpoint_at, None
        if self.checkpoints is None or self.states is None or req.state_slot is None or at is None:
            return
        self._extend_hashes(req, at)
        self.checkpoints.save(req.block_hashes[at // self.block_size - 1], self.states.states, req.state_slot)

    def _extend_hashes(self, req: Request, num_tokens: int) -> None:
        """Hash the request's whole blocks up to `num_tokens` that are not hashed yet."""
        bs = self.block_size
        start, end = len(req.block_hashes), num_tokens // bs
        if end > start:
            parent = req.block_hashes[-1] if req.block_hashes else ROOT_HASH
            req.block_hashes.extend(extend_chain(parent, req.token_ids(start * bs, end * bs), bs))
