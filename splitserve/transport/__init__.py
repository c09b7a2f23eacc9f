"""The transport layer of KV transfer: export / fetch / release of a request's KV blocks (and state)
between workers. The engine's side of the feature is engine/kv_transfer*.py and engine/kv_connector.py
(the names: docs/architecture.md, "Names").

Nothing here depends on the engine: a transport moves the blocks of a plain block-major KV cache tensor
`kv_cache[num_blocks, layers, 2, block_size, kv_heads, head_dim]`. See transport.py for the life of a
request's KV and the contract, channel.py for the one transport (a control channel holding a payload
mover per backend: stream/ for tcp and shm, gpu/ for cuda_ipc and nccl, nixl/), protocol.py for the
wire, and backends.py for what each backend needs. A prefill worker that exports over shm should allocate its
cache with `allocate_shared_kv`: fetchers then copy straight out of it (stream/shm_direct.py).
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from splitserve.transport.errors import (
    AuthError,
    BackendUnavailable,
    CorruptTransfer,
    LeaseExpired,
    PeerRefused,
    TransferTimeout,
    TransportError,
    UnknownLease,
)
from splitserve.wire.kv_handle import KVHandle

if TYPE_CHECKING:
    from splitserve.transport.backends import available_backends, make_transport
    from splitserve.transport.faults import FaultyTransport
    from splitserve.transport.layout import KVLayout
    from splitserve.transport.lease import LeaseManager
    from splitserve.transport.stream.shm_direct import allocate_shared_kv
    from splitserve.transport.transport import KVTransport, TransportOptions

# imported on first use: the errors and the handle (what the workers' front ends need) stay free of
# torch, which the transports' modules load
_LAZY = {
    "available_backends": "splitserve.transport.backends",
    "make_transport": "splitserve.transport.backends",
    "FaultyTransport": "splitserve.transport.faults",
    "KVLayout": "splitserve.transport.layout",
    "LeaseManager": "splitserve.transport.lease",
    "allocate_shared_kv": "splitserve.transport.stream.shm_direct",
    "KVTransport": "splitserve.transport.transport",
    "TransportOptions": "splitserve.transport.transport",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(name)


__all__ = [
    "AuthError",
    "BackendUnavailable",
    "CorruptTransfer",
    "FaultyTransport",
    "KVHandle",
    "KVLayout",
    "KVTransport",
    "LeaseExpired",
    "LeaseManager",
    "PeerRefused",
    "TransferTimeout",
    "TransportError",
    "TransportOptions",
    "UnknownLease",
    "allocate_shared_kv",
    "available_backends",
    "make_transport",
]
