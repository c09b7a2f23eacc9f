"""A hybrid model's state slots as NIXL sees them: the engine's state tensors, registered once, and one
request's slot as descriptors (one per state tensor: its contiguous row).

    states[name]: [num_slots, *shape]   (the engine's StatePool, state_pool.py; in layout order)
    slot s of `name`: bytes [addr + s * row, addr + (s + 1) * row), row = prod(shape) * itemsize

Qwen3.5 keeps two tensors (conv windows and recurrent matrices of every DeltaNet layer), so a request's
state is 2 descriptors, one READ together with its block runs.

Life of a request's state over nixl with registered slots:
  1. start-up, both roles: `StateSlots.register(mover, layout, states)`: every state tensor once.
  2. exporter: the engine passes views of the request's slot to `export`; `slot_of(views)` finds the
     slot (the engine keeps it under the lease: KVConnector.export); the answer names it + the regions.
  3. fetcher: READs `remote_descs(regions, slot)` into `descs(our slot)`: the engine's own slot of the
     imported request (`slot_of(into_state)`), or, without one (a probe), a buffer registered for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import numpy as np
import torch

from splitserve.transport.errors import TransportError
from splitserve.transport.layout import KVLayout, itemsize, torch_dtype
from splitserve.transport.nixl.agent import NixlAgent, Region, descriptors


@dataclass(frozen=True)
class StateSlots:
    """The registered state tensors of one transport, as Regions (a "block" is one slot's row)."""

    regions: tuple[Region, ...]  # layout order

    @classmethod
    def register(
        cls, mover: NixlAgent, layout: KVLayout, states: Mapping[str, torch.Tensor], device: torch.device
    ) -> StateSlots:
        regions = []
        for name, shape, dtype in layout.state_shapes:
            t = states.get(name)
            if t is None or tuple(t.shape[1:]) != tuple(shape) or t.dtype != torch_dtype(dtype):
                got = None if t is None else (tuple(t.shape), t.dtype)
                raise ValueError(f"state {name!r}: got {got}, the layout says [num_slots, *{shape}] {dtype}")
            if not t.is_contiguous() or t.device != device:
                raise ValueError(f"state {name!r} must be one contiguous tensor on {device}")
            regions.append(mover.register(t))
        return cls(tuple(regions))

    def slot_of(self, state: Mapping[str, torch.Tensor] | None, layout: KVLayout) -> int | None:
        """The slot whose rows `state` views (in every registered tensor), or None (copies, or not ours)."""
        if not state or not self.regions:
            return None
        slots = set()
        for (name, _, _), region in zip(layout.state_shapes, self.regions, strict=True):
            t = state.get(name)
            if t is None or not t.is_contiguous() or t.numel() * t.element_size() != region.block_nbytes:
                return None
            offset = t.data_ptr() - region.addr
            if not 0 <= offset < region.nbytes or offset % region.block_nbytes:
                return None
            slots.add(offset // region.block_nbytes)
        return slots.pop() if len(slots) == 1 else None

    def descs(self, slot: int) -> np.ndarray:
        """Nx3 (address, length, device): slot `slot` of each registered tensor."""
        return remote_descs(self.regions, slot)


def remote_descs(regions: tuple[Region, ...], slot: int) -> np.ndarray:
    rows = [descriptors(r, [slot], [1]) for r in regions]
    return np.concatenate(rows) if rows else np.empty((0, 3), dtype=np.uint64)


def peer_regions(
    regions: tuple[Region, ...], layout: KVLayout, index: int, mem: str
) -> tuple[tuple[Region, ...], int]:
    """The exporter's state regions and the slot it names, checked against our layout and its KV memory."""
    if len(regions) != len(layout.state_shapes):
        want = len(layout.state_shapes)
        raise TransportError(f"exporter sent {regions!r} as state regions; the layout has {want} tensors")
    for (name, shape, dtype), region in zip(layout.state_shapes, regions, strict=True):
        row = int(np.prod(shape, dtype=np.int64)) * itemsize(dtype)
        if region.block_nbytes != row or region.mem != mem:
            raise TransportError(f"exporter's state {name!r} is {region}, we expect {row}-byte {mem} rows")
    if any(not 0 <= index < r.num_blocks for r in regions):
        raise TransportError(f"exporter named state slot {index}, outside its state tensors")
    return regions, index
