"""A transport that passes every call of the contract (transport.py) to another one: the base of the
test hooks that change one thing about a real transport (faults.py's `FaultyTransport`, throttle.py's
`ThrottledTransport`) and leave the rest as in production."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.layout import KVLayout
from splitserve.transport.transport import KVTransport
from splitserve.wire.kv_handle import KVHandle


class WrappedTransport(KVTransport):
    def __init__(self, inner: KVTransport) -> None:
        self.inner = inner
        self.backend, self.kv_cache, self.layout, self.stats = (
            inner.backend,
            inner.kv_cache,
            inner.layout,
            inner.stats,
        )

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

    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        return self.inner.check_peer(address, timeout_s)

    def install_faults(self, plan: FaultPlan | None) -> None:
        self.inner.install_faults(plan)

    def describe(self) -> dict:
        return self.inner.describe()

    def close(self) -> None:
        self.inner.close()


__all__ = ["WrappedTransport"]
