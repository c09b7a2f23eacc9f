"""A test hook: a transport whose fetches are held to a bandwidth (a slow link, on purpose).

`ThrottledTransport(inner, gbps)` passes every call of the contract to `inner` and, after each fetch,
sleeps until the fetch has taken at least `bytes / gbps`. The gate (`splitserve verify`) and the
run-time probe must notice; nothing else changes. Enabled only by the worker's `--kv-throttle-gbps`
(tests, drills).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch

from splitserve.kv.fault_plan import FaultPlan
from splitserve.kv.handle import KVHandle
from splitserve.kv.layout import KVLayout
from splitserve.kv.transport import KVTransport


class ThrottledTransport(KVTransport):
    def __init__(self, inner: KVTransport, gbps: float) -> None:
        if gbps <= 0:
            raise ValueError("the throttle must be a positive GB/s")
        self.inner = inner
        self.gbps = gbps
        self.backend, self.kv, self.layout, self.stats = inner.backend, inner.kv, inner.layout, inner.stats

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
        start = time.perf_counter()
        state = self.inner.fetch(handle, into_block_ids, timeout_s, into_state)
        kv = self.inner.kv
        nbytes = len(into_block_ids) * kv[0].numel() * kv.element_size()
        left = nbytes / (self.gbps * 1e9) - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return state

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
        return {**self.inner.describe(), "throttle_gbps": self.gbps}

    def close(self) -> None:
        self.inner.close()


__all__ = ["ThrottledTransport"]
