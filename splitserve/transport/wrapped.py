"""A transport that passes every call of the contract (transport.py) to another one: the base of the
test hooks that change one thing about a real transport (faults.py's `FaultyTransport`, throttle.py's
`ThrottledTransport`) and leave the rest as in production."""

from __future__ import annotations

from collections.abc import Mapping

import torch

from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.layout import KVLayout
from splitserve.transport.transport import ExportRequest, FetchRequest, KVTransport
from splitserve.wire.kv_handle import KVHandle
from splitserve.wire.transport_info import TransportInfo


class WrappedTransport(KVTransport):
    def __init__(self, inner: KVTransport) -> None:
        self.inner = inner
        self.backend, self.kv_cache, self.layout, self.stats = (
            inner.backend,
            inner.kv_cache,
            inner.layout,
            inner.stats,
        )

    def export_request(self, request: ExportRequest) -> KVHandle:
        return self.inner.export_request(request)

    def release(self, handle: KVHandle) -> None:
        self.inner.release(handle)

    def fetch_request(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        return self.inner.fetch_request(request)

    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return self.inner.register_states(states)

    def listen(self) -> str:
        return self.inner.listen()

    @property
    def address(self) -> str | None:
        return self.inner.address

    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        return self.inner.check_peer(address, timeout_s)

    def install_faults(self, plan: FaultPlan | None) -> None:
        self.inner.install_faults(plan)

    def describe(self) -> TransportInfo:
        return self.inner.describe()

    def close(self) -> None:
        self.inner.close()


__all__ = ["WrappedTransport"]
