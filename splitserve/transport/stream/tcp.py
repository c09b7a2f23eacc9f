"""tcp: the KV payload as the body of one frame on the authenticated connection.

Life of a fetch over tcp:
  1. fetcher -> Fetch {lease_id, timeout_s}
  2. exporter -> Kv {nbytes, blocks, checksum} + nbytes of body, sent with scatter-gather
     `sendmsg` straight from the leased blocks (the frame header, then one iovec per run of
     consecutive block ids, then the state tensors): no staging copy. A fetch that selects some
     heads and state channels (`Fetch.select`) gets those only, gathered into one host tensor per
     part; the fetcher receives them straight into its own blocks (an iovec per row and run).
  3. fetcher: `recvmsg_into` straight into its own kv[into_block_ids] views and fresh state tensors,
     then the checksum (channel.py).

On a GPU the blocks would be staged through one host buffer on each side (payload.py); the wire is
the same. The exporter binds `options.host:options.port` (port 0: the OS picks) and the handle
carries the real address.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

from splitserve.transport.channel import KVChannel
from splitserve.transport.client import SyncChannel
from splitserve.transport.errors import TransportError
from splitserve.transport.export_requests import PayloadCall
from splitserve.transport.fault_plan import Fault
from splitserve.transport.frames import Kv, Select
from splitserve.transport.layout import KVLayout
from splitserve.transport.payload import ByteStream, selected_pieces, source_pieces, state_pieces
from splitserve.transport.port import MoverPort
from splitserve.transport.protocol import Deadline, checksum_like, encode_frame, expect
from splitserve.transport.server import ListenSpec
from splitserve.transport.stream.mover import StreamMover
from splitserve.wire.transport_info import MoverInfo


class TcpWire:
    """The payload as the body of one frame on the control connection (the module docstring)."""

    backend = "tcp"

    def bind(self, port: MoverPort) -> None:
        self.kv_cache, self.layout, self.options = port.kv_cache, port.layout, port.options

    def listen_spec(self) -> ListenSpec:
        return ListenSpec("tcp", host=self.options.host, port=self.options.port)

    async def send_payload(self, call: PayloadCall) -> int:
        chan, export, block_ids, fault, deadline = call.unpack()
        select, digest = call.request.select, export.checksum
        if select is None:
            pieces = source_pieces(self.kv_cache, block_ids) + state_pieces(export.state, self.layout)
            body = ByteStream(pieces)
        else:  # some heads and state channels, gathered into host tensors (payload.py)
            body = ByteStream(selected_pieces(self.kv_cache, self.layout, block_ids, export.state, select))
            digest = checksum_like(digest, body.pieces)
        if fault is Fault.CORRUPT and call.plan is not None:
            body = call.plan.corrupted(body)
        header = Kv(blocks=len(block_ids), checksum=digest, nbytes=body.nbytes)
        frame = encode_frame(header, body_nbytes=body.nbytes)
        stream = ByteStream(
            [np.frombuffer(frame, dtype=np.uint8), *body.pieces]
        )  # one sendmsg: no extra wake-up
        await chan.send_stream(
            stream, deadline, len(frame) + body.nbytes // 2 if fault is Fault.KILL else None
        )
        return body.nbytes

    def recv_payload(
        self, chan: SyncChannel, stream: ByteStream, deadline: Deadline, select: Select | None = None
    ) -> Kv:
        header, body_nbytes = chan.recv(deadline)
        meta = expect(header, Kv)
        if body_nbytes != stream.nbytes or meta.nbytes != stream.nbytes:
            raise TransportError(f"exporter sends {body_nbytes} bytes, we expect {stream.nbytes}")
        chan.recv_stream(stream, deadline)
        return meta

    def describe(self) -> MoverInfo:
        return MoverInfo()

    def close(self) -> None:
        pass


class TcpTransport(KVChannel):
    """The control channel with a StreamMover over the tcp wire."""

    def __init__(self, kv: torch.Tensor, layout: KVLayout, **kwargs: Any) -> None:
        super().__init__(kv, layout, StreamMover(TcpWire()), **kwargs)
