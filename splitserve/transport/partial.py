"""A test hook: a fetcher whose payload mover writes only part of each payload, and says so.

`PartialTransport(inner, fraction)` runs every fetch on `inner`, then puts back what the blocks past
the first `fraction` of the fetch held before it and takes their bytes off the transport's
`fetched_bytes` count: the fetch succeeds, the decode worker's KV lacks the rest of the prompt, and
the counters show the shortfall, as with a mover handed a descriptor list cut short. What `splitserve
verify` ("handoff bytes") and the bytes-per-handed-off-token alert must catch. Enabled only by the
worker's `--kv-fetch-fraction` (tests, drills).
"""

from __future__ import annotations

import logging

import msgspec
import torch

from splitserve.transport.transport import FetchRequest, KVTransport
from splitserve.transport.wrapped import WrappedTransport
from splitserve.wire.transport_info import TransportInfo

log = logging.getLogger(__name__)


class PartialTransport(WrappedTransport):
    def __init__(self, inner: KVTransport, fraction: float) -> None:
        if not 0 <= fraction < 1:
            raise ValueError("the fetched fraction must be in [0, 1)")
        super().__init__(inner)
        self.fraction = fraction

    def fetch_request(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        ids = list(request.into_block_ids)
        lost = ids[int(len(ids) * self.fraction) :]
        kv = self.inner.kv_cache
        before = kv[lost].clone()  # [len(lost), layers, 2, block_size, kv_heads, head_dim]
        state = self.inner.fetch_request(request)
        kv[lost] = before  # these blocks never arrived
        self.stats.count("fetched_bytes", -len(lost) * kv[0].numel() * kv.element_size())
        return state

    def describe(self) -> TransportInfo:
        return msgspec.structs.replace(self.inner.describe(), fetch_fraction=self.fraction)


def with_test_hooks(
    transport: KVTransport, throttle_gbps: float | None = None, fetch_fraction: float | None = None
) -> KVTransport:
    """`transport` wrapped by the test hooks a worker was started with (none: itself)."""
    if throttle_gbps:
        from splitserve.transport.throttle import ThrottledTransport

        log.warning("kv fetches throttled to %.3f GB/s (a test hook)", throttle_gbps)
        transport = ThrottledTransport(transport, throttle_gbps)
    if fetch_fraction is not None:
        log.warning("kv fetches land %.0f%% of their blocks (a test hook)", fetch_fraction * 100)
        transport = PartialTransport(transport, fetch_fraction)
    return transport


__all__ = ["PartialTransport", "with_test_hooks"]
