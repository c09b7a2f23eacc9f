"""shm: same-host transfers through shared memory, controlled over an authenticated unix socket.

The control connection is the protocol of protocol.py on a unix socket whose path is new for each
exporter (in `options.socket_dir`, else a fresh temp dir): same host by construction. The payload
takes one of two paths, picked by the exporter:

  direct  (shm_direct.py) the exporter's KV was allocated with `allocate_shared_kv`: the fetcher maps
          the whole cache read-only once per connection and copies the blocks out itself, one memcpy.
  staged  (shm_staged.py) any other KV: the payload streams through two slots of a segment made per
          connection; the exporter copies out of its blocks while the fetcher copies into its own.

Both send the state tensors along, and the fetcher checks the checksum afterwards (channel.py). A
fetch that selects some heads and state channels (`Fetch.select`) moves those only, on either path.
"""

from __future__ import annotations

from typing import Any

import torch

from splitserve.transport.channel import KVChannel
from splitserve.transport.client import SyncChannel
from splitserve.transport.errors import TransportError
from splitserve.transport.export_requests import PayloadCall
from splitserve.transport.frames import KvDirect, KvShm, Payload, Select
from splitserve.transport.layout import KVLayout
from splitserve.transport.payload import (
    ByteStream,
    channel_pieces,
    check_select,
    selected_nbytes,
    selected_pieces,
    source_pieces,
    state_pieces,
)
from splitserve.transport.port import MoverPort
from splitserve.transport.protocol import Deadline, checksum_like, expect
from splitserve.transport.server import ListenSpec, UnixSocketPath
from splitserve.transport.stream.mover import StreamMover
from splitserve.transport.stream.shm_direct import allocate_shared_kv, recv_direct, send_direct, shared_kv_of
from splitserve.transport.stream.shm_staged import SEGMENT_PREFIX, recv_staged, send_staged
from splitserve.wire.transport_info import MoverInfo

__all__ = ["SEGMENT_PREFIX", "ShmWire", "ShmTransport", "allocate_shared_kv"]


class ShmWire:
    """The payload through shared memory, direct or staged (the module docstring)."""

    backend = "shm"

    def __init__(self) -> None:
        self.socket_path = UnixSocketPath()

    def bind(self, port: MoverPort) -> None:
        self.kv_cache, self.layout, self.options = port.kv_cache, port.layout, port.options

    @property
    def mode(self) -> str:
        return "direct" if shared_kv_of(self.kv_cache) is not None else "staged"

    def listen_spec(self) -> ListenSpec:
        return self.socket_path.listen_spec(self.options.socket_dir)

    async def send_payload(self, call: PayloadCall) -> int:
        chan, export, block_ids, fault, deadline = call.unpack()
        shared, select = shared_kv_of(self.kv_cache), call.request.select
        if shared is not None:  # the fetcher copies the blocks (or its heads of them) itself
            digest, state = export.checksum, ByteStream(state_pieces(export.state, self.layout))
            if select is not None:
                check_select(self.layout, select)
                if digest:
                    pieces = selected_pieces(self.kv_cache, self.layout, block_ids, export.state, select)
                    digest = checksum_like(digest, pieces)
                state = ByteStream(channel_pieces(export.state, select.states))
            await send_direct(chan, shared, block_ids, state, digest, deadline, fault)
            return selected_nbytes(self.layout, len(block_ids), select)
        if select is None:
            pieces = source_pieces(self.kv_cache, block_ids) + state_pieces(export.state, self.layout)
            stream = ByteStream(pieces)
            digest = export.checksum
        else:
            stream = ByteStream(selected_pieces(self.kv_cache, self.layout, block_ids, export.state, select))
            digest = checksum_like(export.checksum, stream.pieces)
        slot_nbytes = self.options.shm_chunk_mb << 20
        await send_staged(chan, stream, len(block_ids), digest, slot_nbytes, deadline, fault, call.plan)
        return stream.nbytes

    def recv_payload(
        self, chan: SyncChannel, stream: ByteStream, deadline: Deadline, select: Select | None = None
    ) -> Payload:
        header, body_nbytes = chan.recv(deadline)
        if isinstance(header, KvDirect):
            recv_direct(chan, header, body_nbytes, stream, deadline, select)
            return header
        meta = expect(header, KvShm)
        if meta.nbytes != stream.nbytes:
            raise TransportError(f"exporter sends {meta.nbytes} bytes, we expect {stream.nbytes}")
        recv_staged(chan, meta, stream, deadline)
        return meta

    def describe(self) -> MoverInfo:
        return MoverInfo(shm_mode=self.mode)

    def close(self) -> None:
        self.socket_path.close()


class ShmTransport(KVChannel):
    """The control channel (on a unix socket) with a StreamMover over the shm wire."""

    def __init__(self, kv: torch.Tensor, layout: KVLayout, **kwargs: Any) -> None:
        super().__init__(kv, layout, StreamMover(ShmWire()), **kwargs)
