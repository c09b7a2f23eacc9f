"""Prefix caching for hybrid models: recurrent-state checkpoints at block boundaries.

A hybrid model's prefix is reusable only where both its KV blocks (cached by content hash, as for any
model) and its recurrent state at the prefix's end are known. This cache keeps such states:

    checkpoints[name]  [num_entries, *state_shape]   (the StatePool's shapes and dtypes)
    by the content hash of the block that ends the prefix (the hash chain covers every earlier token)

How a request uses it (BlockManager):
1. At admission the KV prefix hit is cut back to the longest prefix ending at a checkpoint; the
   state is copied into the request's fresh slot and the tokens before it are not computed.
2. Where the KV hit reaches further than any checkpoint (a prefix shared with an earlier request,
   e.g. a system prompt followed by another question), the request's prefill is split there: its
   first chunk ends exactly at the shared block boundary, and the state after that chunk is saved.
   So the second request sharing a prefix records it and every later one skips it, whatever follows
   the prefix (SGLang misses a shared prefix followed by a long suffix), and blocks stay 16 tokens
   (vLLM grows them to 528+ tokens for hybrid models).
3. Entries are evicted least recently used; a checkpoint whose KV blocks were evicted is simply not
   reached (the KV hit stops earlier).

The copies are queued on the engine's stream in step order, so a save sees the state right after the
chunk that ended at the boundary and a restore lands before the request's next forward.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splitserve.engine.kv_events import KVEventLog


class StateCheckpoints:
    def __init__(self, shapes: dict[str, tuple[tuple[int, ...], torch.dtype]], num_entries: int,
                 device: torch.device) -> None:  # fmt: skip
        self.num_entries = num_entries if shapes else 0
        self.tensors = {
            name: torch.zeros((self.num_entries, *shape), dtype=dtype, device=device)
            for name, (shape, dtype) in shapes.items()
        }
        self._index: OrderedDict[bytes, int] = OrderedDict()  # block hash -> entry, oldest use first
        self._free = list(range(self.num_entries - 1, -1, -1))
        self.saved = 0
        self.restored = 0
        self.events: KVEventLog | None = None  # what cache-aware routers follow (kv_events.py)

    @property
    def enabled(self) -> bool:
        return self.num_entries > 0

    def __contains__(self, block_hash: bytes) -> bool:
        return block_hash in self._index

    def __len__(self) -> int:
        return len(self._index)

    def save(self, block_hash: bytes, states: dict[str, torch.Tensor], slot: int) -> None:
        """Checkpoint slot `slot` of the state pool (`states[name][slot]`) under `block_hash`."""
        entry = self._index.pop(block_hash, None)
        if entry is None:
            if self._free:
                entry = self._free.pop()
            else:
                evicted, entry = self._index.popitem(last=False)
                if self.events is not None:
                    self.events.record("checkpoint_removed", evicted)
            if self.events is not None:
                self.events.record("checkpoint_stored", block_hash)
        self._index[block_hash] = entry
        for name, t in self.tensors.items():
            t[entry].copy_(states[name][slot], non_blocking=True)
        self.saved += 1

    def restore(self, block_hash: bytes, states: dict[str, torch.Tensor], slot: int) -> None:
        """states[name][slot] := the checkpoint under `block_hash` (which must be present)."""
        entry = self._index[block_hash]
        self._index.move_to_end(block_hash)
        for name, t in self.tensors.items():
            states[name][slot].copy_(t[entry], non_blocking=True)
        self.restored += 1

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())
