"""CPU: map the KV cache's pages ahead of use, on idle loop turns.

The CPU KV cache is calloc'ed (engine/config.py `allocate_kv_cache`): its pages are mapped on their
first write. On the 2-vCPU VMs of this repo a first write to a page costs ~5 us, so a prefill into
blocks the pool has never handed out spends ~0.1 s of a 2,048-token step (~15 ms of a 256-token one)
faulting in pages (docs/bench/cpu-engine.md), and a fresh server's pool hands out never-used blocks
first (block_pool.py: the free queue is in eviction order, never-used blocks at its front).

`KVPrefault.advance()` writes zeros into the next few never-used blocks (the pool's
`[fresh_from, num_blocks)`, in the order it will hand them out), keeping up to `limit_bytes` of them
mapped ahead of the pool's use. A never-used block holds no request's data and is handed out only by
the engine's own thread, the one that calls this, so the write is safe. It commits that much memory
beyond the blocks in use; `SPLITSERVE_KV_PREFAULT_MB` sets the limit (default 1024; 0 turns it off).
"""

from __future__ import annotations

import os

import torch

from splitserve.engine.block_pool import BlockPool

LIMIT_BYTES = int(os.environ.get("SPLITSERVE_KV_PREFAULT_MB", "1024")) << 20
CHUNK_BYTES = 1 << 20  # one turn's work: ~1 ms here, the most a request arriving meanwhile waits


class KVPrefault:
    def __init__(self, kv: torch.Tensor, pool: BlockPool, limit_bytes: int = LIMIT_BYTES) -> None:
        self.kv, self.pool = kv, pool
        block_bytes = kv[0].numel() * kv.element_size()
        self.ahead = limit_bytes // block_bytes  # blocks kept mapped beyond the pool's use
        self.chunk = max(1, CHUNK_BYTES // block_bytes)
        self.next = 0  # the first block not yet written here
        self.on = kv.device.type == "cpu" and self.ahead > 0

    def advance(self) -> bool:
        """Zero the next chunk of never-used blocks; -> whether more remain within the limit."""
        if not self.on:
            return False
        limit = min(self.pool.fresh_from + self.ahead, self.pool.num_blocks)
        start = max(self.next, self.pool.fresh_from)
        end = min(start + self.chunk, limit)
        if start >= end:
            return False
        self.kv[start:end].zero_()
        self.next = end
        return end < limit
