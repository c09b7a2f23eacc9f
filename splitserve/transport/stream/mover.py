"""StreamMover: the payload mover of the two backends that stream through the host (tcp, shm).

The payload streams on the control connection (or beside it), the state travels as host copies and
every fetch asks the exporter. What differs between tcp and shm is only the wire: where the server
listens and how the bytes of one payload cross (`StreamWire`, a Protocol: tcp.TcpWire, shm.ShmWire).
The mover holds its wire and does the rest itself, so neither backend forwards a call it does not
change, and neither subclasses anything.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import TYPE_CHECKING, Protocol

import torch

from splitserve.transport.board import LeaseBoard
from splitserve.transport.client import SyncChannel
from splitserve.transport.frames import Frame, Payload, Select
from splitserve.transport.payload import ByteStream, snapshot_state
from splitserve.transport.protocol import Deadline
from splitserve.transport.server import AsyncChannel, ListenSpec
from splitserve.transport.transport import ExportRequest, FetchRequest
from splitserve.wire.kv_handle import KVHandle
from splitserve.wire.transport_info import MoverInfo

if TYPE_CHECKING:
    from splitserve.transport.export_requests import PayloadCall
    from splitserve.transport.port import MoverPort


class StreamWire(Protocol):
    """How one payload crosses between hosts' processes; the rest of the mover contract is StreamMover's."""

    backend: str

    def bind(self, port: MoverPort) -> None:
        """Once, when the channel is made."""
        ...

    def listen_spec(self) -> ListenSpec:
        """Exporter: where the control server listens."""
        ...

    async def send_payload(self, call: PayloadCall) -> int:
        """Exporter: the pinned lease's blocks and state (the payload frame first); -> bytes sent."""
        ...

    def recv_payload(
        self, chan: SyncChannel, stream: ByteStream, deadline: Deadline, select: Select | None = None
    ) -> Payload:
        """Fetcher: fill `stream` (our blocks' views, then fresh state tensors; or, for a fetch that
        `select`s some heads and state channels, the views those go to); -> the payload frame."""
        ...

    def describe(self) -> MoverInfo: ...

    def close(self) -> None: ...


class StreamMover:
    """A PayloadMover (channel.py) over a StreamWire: export under the channel's lease, host copies of
    the state, fetch by asking the exporter and letting the wire fill our blocks' views."""

    def __init__(self, wire: StreamWire) -> None:
        self.wire = wire
        self.backend = wire.backend

    def bind(self, port: MoverPort) -> None:
        self.port = port
        self.wire.bind(port)

    # -- the mover contract (channel.py) -----------------------------------------------------------
    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return False  # the state travels as host copies

    def make_board(self) -> LeaseBoard | None:
        return None  # every fetch asks the exporter

    def listen_spec(self) -> ListenSpec:
        return self.wire.listen_spec()

    def export(self, request: ExportRequest) -> KVHandle:
        return self.port.lease_export(request, self.port.check_ids(request.block_ids, "block_ids"))

    def keep_state(self, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Host copies (the engine reuses its slot at once)."""
        return snapshot_state(self.port.layout, state)

    async def serve_op(self, chan: AsyncChannel, frame: Frame) -> bool | None:
        return None  # no open exchange

    async def send_payload(self, call: PayloadCall) -> int:
        return await self.wire.send_payload(call)

    def fetch(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        return self.port.stream_fetch(request, self.wire.recv_payload)

    def fetch_part(self, request: FetchRequest, select: Select, into: ByteStream) -> None:
        """Only the `select`ed heads and state channels, into the views `into` (channel.py)."""
        self.port.stream_fetch(request, self.wire.recv_payload, (select, into))

    def describe(self) -> MoverInfo:
        return self.wire.describe()

    def close(self) -> None:
        self.wire.close()


__all__ = ["StreamMover", "StreamWire"]
