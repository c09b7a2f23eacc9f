"""Fault injection for the error paths: an exporter that drops, stalls, corrupts or hangs up.

`FaultyTransport(inner, drop=.., delay=.., corrupt=.., kill=.., seed=..)` wraps a transport and installs
a `FaultPlan` (fault_plan.py) on its server. For every fetch the server serves, the plan draws one fault
(seeded, so a test is repeatable): drop, delay, corrupt or kill (fault_plan.py says what each does).

Everything else is passed through to the inner transport, so fetch / export / release / describe
behave as they would in production.
"""

from __future__ import annotations

import msgspec

from splitserve.transport.fault_plan import Fault, FaultKnobs, FaultPlan
from splitserve.transport.transport import KVTransport
from splitserve.transport.wrapped import WrappedTransport
from splitserve.wire.transport_info import TransportInfo

__all__ = ["Fault", "FaultKnobs", "FaultPlan", "FaultyTransport"]


class FaultyTransport(WrappedTransport):
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
        super().__init__(inner)
        self.plan = FaultPlan(FaultKnobs(drop, delay, corrupt, kill, delay_s, seed))
        inner.install_faults(self.plan)

    def describe(self) -> TransportInfo:
        return msgspec.structs.replace(self.inner.describe(), fault_knobs=self.plan.knobs)
