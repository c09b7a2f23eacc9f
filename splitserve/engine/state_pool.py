"""Per-sequence recurrent-state slots for hybrid models, managed beside the KV block pool.

A linear-attention layer keeps a fixed-size state per sequence (a conv window and a recurrent
matrix) instead of growing KV. Each running request holds one slot from admission until it
finishes, is aborted or is preempted; a slot is zeroed when handed out, so a fresh sequence
(or a recomputed one) starts from the zero state.

    states[name]: [num_slots, *shape]     (fp32)
"""

from __future__ import annotations

from typing import Any

import torch


class StatePool:
    def __init__(
        self,
        shapes: dict[str, tuple[tuple[int, ...], torch.dtype]],
        num_slots: int,
        device: torch.device,
        scratch_slot: bool = False,
    ) -> None:
        """`scratch_slot`: one more slot, never handed out (`self.scratch`), for the padded rows of a
        CUDA-graph decode step to write into."""
        self.num_slots = num_slots if shapes else 0
        extra = 1 if scratch_slot and shapes else 0
        self.states = {
            name: torch.zeros((self.num_slots + extra, *shape), dtype=dtype, device=device)
            for name, (shape, dtype) in shapes.items()
        }
        self.scratch: int | None = self.num_slots if extra else None
        self._free = list(range(self.num_slots - 1, -1, -1))
        self._held: list[tuple[int, Any]] = []  # (slot, done): freed once done.query() (free_after)

    @property
    def enabled(self) -> bool:
        return bool(self.states)

    @property
    def num_free(self) -> int:
        self._reclaim()
        return len(self._free)

    def allocate(self) -> int | None:
        self._reclaim()
        if not self._free:
            return None
        slot = self._free.pop()
        for t in self.states.values():
            t[slot].zero_()
        return slot

    def free(self, slot: int) -> None:
        assert slot not in self._free, f"state slot {slot} freed twice"
        self._free.append(slot)

    def free_after(self, slot: int, done: Any) -> None:
        """`free(slot)` once `done.query()` is true: a failed fetch that may still write the slot
        (a NIXL READ of the state in place) keeps it out of the free list until then."""
        self._held.append((slot, done))

    def _reclaim(self) -> None:
        if self._held:
            held, self._held = self._held, []
            for slot, done in held:
                if done.query():
                    self.free(slot)
                else:
                    self._held.append((slot, done))

    def nbytes_per_slot(self) -> int:
        return sum(t[0].numel() * t.element_size() for t in self.states.values())
