"""MoverPort: what a payload mover may use of the control channel that holds it (channel.py).

A mover is handed a port once (`bind(port)`), never the channel: the KV cache and its layout, the
options, the counters, the leases and the fetcher's connection pool, and the few channel steps a mover
finishes its work with (start the server, put checked blocks under a lease, check a handle or ids,
verify a checksum, run a stream fetch). Everything else of the channel (its server, its fault plan,
its close) stays the channel's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from splitserve.transport.client import ConnectionPool
    from splitserve.transport.frames import Payload
    from splitserve.transport.layout import KVLayout
    from splitserve.transport.lease import LeaseManager
    from splitserve.transport.payload import ByteStream
    from splitserve.transport.transport import ExportRequest, TransportOptions, TransportStats
    from splitserve.wire.kv_handle import KVHandle

    RecvPayload = Callable[..., Payload]  # (chan, stream, deadline, select=None)


@dataclass(frozen=True)
class MoverPort:
    """The channel's parts a mover uses (the module docstring)."""

    kv_cache: torch.Tensor  # [num_blocks, L, 2, block_size, KVH, D]
    layout: KVLayout
    options: TransportOptions
    stats: TransportStats
    leases: LeaseManager
    pool: ConnectionPool
    # exporter: start serving (once) -> the address handles carry
    listen: Callable[[], str]
    # exporter: keep the state, the checksum and a lease for block ids already checked -> the handle
    lease_export: Callable[[ExportRequest, tuple[int, ...]], KVHandle]
    # both: distinct ids inside the cache, or ValueError naming `what`
    check_ids: Callable[[Sequence[int], str], tuple[int, ...]]
    # fetcher: the handle is ours to fetch (backend, block count) -> the checked destination ids
    check_fetch: Callable[[KVHandle, Sequence[int]], tuple[int, ...]]
    # fetcher: the payload's checksum against the handle's, else the one the exporter sent (CorruptTransfer)
    verify: Callable[[KVHandle, str | None, ByteStream], None]
    # fetcher, stream movers: the whole fetch around their `recv_payload` (request, recv_payload, and
    # for part of a payload (select, the views it goes to))
    stream_fetch: Callable[..., dict[str, torch.Tensor]]


__all__ = ["MoverPort"]
