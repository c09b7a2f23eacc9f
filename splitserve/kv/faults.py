"""Fault injection for the error paths: an exporter that drops, stalls, corrupts or hangs up.

`FaultyTransport(inner, drop=.., delay=.., corrupt=.., kill=.., seed=..)` wraps a transport and installs
a `FaultPlan` (fault_plan.py) on its server. For every fetch the server serves, the plan draws one fault
(seeded, so a test is repeatable): drop, delay, corrupt or kill (fault_plan.py says what each does).

Everything else is passed through to the inner transport, so fetch / export / release / describe
behave as they would in production.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict

import torch

from splitserve.kv.fault_plan import Fault, FaultKnobs, FaultPlan
from splitserve.kv.handle import KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.transport import KVTransport

__all__ = ["Fault", "FaultKnobs", "FaultPlan", "FaultyTransport"]


class FaultyTransport(KVTransport):
    """A transport whose exporter misbehaves on purpose (tests of the error paths)."""

    def __init__(
        self,
        inner: KVTransport,
        *,
        drop: float = 0.0,
        delay: float = 0.0,
        corrupt: float = 0.0,
        kill: float = 0.0,
        delay_s: float = 5.0,
        seed: int = 0,
    ) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.kv = inner.kv
        self.layout = inner.layout
        self.stats = inner.stats
        self.plan = FaultPlan(FaultKnobs(drop, delay, corrupt, kill, delay_s, seed))
        inner.install_faults(self.plan)

    def export(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> KVHandle:
        return self.inner.export(request_id, block_ids, num_tokens, state)

    def release(self, handle: KVHandle) -> None:
        self.inner.release(handle)

    def fetch(
        self,
        handle: KVHandle,
        into_block_ids: Sequence[int],
        timeout_s: float | None = None,
        into_state: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        return self.inner.fetch(handle, into_block_ids, timeout_s, into_state)

    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return self.inner.register_states(states)

    def listen(self) -> str:
        return self.inner.listen()

    @property
    def address(self) -> str | None:
        return self.inner.address

    def install_faults(self, plan: FaultPlan | None) -> None:
        self.inner.install_faults(plan)

    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        return self.inner.check_peer(address, timeout_s)

    def describe(self) -> dict:
        return {**self.inner.describe(), "fault_knobs": asdict(self.plan.knobs)}

    def close(self) -> None:
        self.inner.close()
