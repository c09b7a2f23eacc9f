"""State-slot operations of rank 0's scheduler, replayed by the other ranks before the next step.

Only rank 0 schedules, but every rank holds its heads' recurrent state. Three scheduler operations
touch that state outside the model's forward: zeroing a slot handed to a request (StatePool.allocate),
saving a slot as a prefix-cache checkpoint and restoring one into a slot (StateCheckpoints). Rank 0's
pool and checkpoints record each as it happens; the runner sends the record with the next step, and
each rank applies it, in order, to its own tensors before running that step. Block tables need no
journal: they travel in the step itself.
"""

from __future__ import annotations

from typing import Any

import torch

from splitserve.engine.state_cache import StateCheckpoints
from splitserve.engine.state_pool import StatePool
from splitserve.engine.tp.rank_reads import held_tensor

# ("zero", slot, 0) | ("save", entry, slot) | ("restore", entry, slot)
# | ("put", slot, {rank: {name: Held}}): a KV import's state, each rank's own channels, which that rank
#   read and keeps (rank_reads.py)
Op = tuple[str, int, Any]


class JournaledStatePool(StatePool):
    journal: list[Op]

    def allocate(self) -> int | None:
        slot = super().allocate()
        if slot is not None:
            self.journal.append(("zero", slot, 0))
        return slot

    def put_ranks(self, slot: int, state: dict[str, Any]) -> None:
        """An imported request's state for the other ranks (`name@rank` keys of a tensor-parallel
        fetch): each rank copies its own into `slot` before the next step, after the slot's zeroing."""
        ranks: dict[int, dict[str, torch.Tensor]] = {}
        for key, t in state.items():
            name, _, rank = key.partition("@")
            if rank:
                ranks.setdefault(int(rank), {})[name] = t
        if ranks:
            self.journal.append(("put", slot, ranks))


class JournaledCheckpoints(StateCheckpoints):
    journal: list[Op]

    def save(self, block_hash: bytes, states: dict[str, torch.Tensor], slot: int) -> None:
        super().save(block_hash, states, slot)
        self.journal.append(("save", self._index[block_hash], slot))

    def restore(self, block_hash: bytes, states: dict[str, torch.Tensor], slot: int) -> None:
        super().restore(block_hash, states, slot)
        self.journal.append(("restore", self._index[block_hash], slot))


def replay(
    ops: list[Op], states: dict[str, torch.Tensor], checkpoints: StateCheckpoints | None, rank: int
) -> None:
    """Apply rank 0's operations to this rank's state pool and checkpoints."""
    for op, a, b in ops:
        if op == "put":
            for name, t in b.get(rank, {}).items():
                states[name][a].copy_(held_tensor(t))
        elif op == "zero":
            for t in states.values():
                t[a].zero_()
        elif op == "save" and checkpoints is not None:
            for name, t in checkpoints.tensors.items():
                t[a].copy_(states[name][b])
        elif op == "restore" and checkpoints is not None:
            for name, t in checkpoints.tensors.items():
                states[name][b].copy_(t[a])


__all__ = ["JournaledCheckpoints", "JournaledStatePool", "Op", "replay"]
