"""A test hook: a transport whose fetches are held to a bandwidth (a slow link, on purpose).

`ThrottledTransport(inner, gbps)` passes every call of the contract to `inner` and, after each fetch,
sleeps until the fetch has taken at least `bytes / gbps`. The gate (`splitserve verify`) and the
run-time probe must notice; nothing else changes. Enabled only by the worker's `--kv-throttle-gbps`
(tests, drills).
"""

from __future__ import annotations

import time

import msgspec
import torch

from splitserve.transport.transport import FetchRequest, KVTransport
from splitserve.transport.wrapped import WrappedTransport
from splitserve.wire.transport_info import TransportInfo


class ThrottledTransport(WrappedTransport):
    def __init__(self, inner: KVTransport, gbps: float) -> None:
        if gbps <= 0:
            raise ValueError("the throttle must be a positive GB/s")
        super().__init__(inner)
        self.gbps = gbps

    def fetch_request(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        start = time.perf_counter()
        state = self.inner.fetch_request(request)
        kv = self.inner.kv_cache
        nbytes = len(request.into_block_ids) * kv[0].numel() * kv.element_size()
        left = nbytes / (self.gbps * 1e9) - (time.perf_counter() - start)
        if left > 0:
            time.sleep(left)
        return state

    def describe(self) -> TransportInfo:
        return msgspec.structs.replace(self.inner.describe(), throttle_gbps=self.gbps)


__all__ = ["ThrottledTransport"]
