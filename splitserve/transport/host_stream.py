"""StreamMover: the payload mover of the two backends that stream through the host (tcp, shm).

The payload streams on the control connection (or beside it), the state travels as host copies and
every fetch asks the exporter. What differs between tcp and shm is only the wire: where the server
listens and how the bytes of one payload cross (`StreamWire`, a Protocol: tcp.TcpWire, shm.ShmWire).
The mover holds its wire and does the rest itself, so neither backend forwards a call it does not
change, and neither subclasses anything.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from splitserve.transport.board import LeaseBoard
from splitserve.transport.client import SyncChannel
from splitserve.transport.fault_plan import Fault
from splitserve.transport.payload import ByteStream, snapshot_state
from splitserve.transport.protocol import Deadline
from splitserve.transport.server import AsyncChannel, ListenSpec
from splitserve.wire.kv_handle import KVHandle

if TYPE_CHECKING:
    from splitserve.transport.channel import KVChannel
    from splitserve.transport.export_requests import Export


class StreamWire(Protocol):
    """How one payload crosses between hosts' processes; the rest of the mover contract is StreamMover's."""

    backend: str

    def bind(self, ch: KVChannel) -> None:
        """Once, when the channel is made."""
        ...

    def listen_spec(self) -> ListenSpec:
        """Exporter: where the control server listens."""
        ...

    async def send_payload(
        self, chan: AsyncChannel, export: Export, block_ids: tuple[int, ...], meta: dict,
        fault: Fault, deadline: Deadline,
    ) -> int:  # fmt: skip
        """Exporter: the pinned lease's blocks and state (the `meta` header first); -> bytes sent."""
        ...

    def recv_payload(self, chan: SyncChannel, stream: ByteStream, deadline: Deadline) -> dict:
        """Fetcher: fill `stream` (our blocks' views, then fresh state tensors); -> the payload header."""
        ...

    def describe(self) -> dict: ...

    def close(self) -> None: ...


class StreamMover:
    """A PayloadMover (channel.py) over a StreamWire: export under the channel's lease, host copies of
    the state, fetch by asking the exporter and letting the wire fill our blocks' views."""

    def __init__(self, wire: StreamWire) -> None:
        self.wire = wire
        self.backend = wire.backend

    def bind(self, ch: KVChannel) -> None:
        self.ch = ch
        self.wire.bind(ch)

    # -- the mover contract (channel.py) -----------------------------------------------------------
    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return False  # the state travels as host copies

    def make_board(self) -> LeaseBoard | None:
        return None  # every fetch asks the exporter

    def listen_spec(self) -> ListenSpec:
        return self.wire.listen_spec()

    def export(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> KVHandle:
        return self.ch.lease_export(request_id, self.ch.check_ids(block_ids, "block_ids"), num_tokens, state)

    def keep_state(self, state: Mapping[str, torch.Tensor] | None) -> dict[str, torch.Tensor]:
        """Host copies (the engine reuses its slot at once)."""
        return snapshot_state(self.ch.layout, state)

    async def serve_op(self, chan: AsyncChannel, header: dict) -> bool | None:
        return None  # no open exchange

    async def send_payload(
        self, chan: AsyncChannel, export: Export, block_ids: tuple[int, ...], meta: dict,
        fault: Fault, deadline: Deadline,
    ) -> int:  # fmt: skip
        return await self.wire.send_payload(chan, export, block_ids, meta, fault, deadline)

    def fetch(
        self,
        handle: KVHandle,
        into_block_ids: Sequence[int],
        timeout_s: float | None = None,
        into_state: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        return self.ch.stream_fetch(handle, into_block_ids, timeout_s, self.wire.recv_payload)

    def describe(self) -> dict:
        return self.wire.describe()

    def close(self) -> None:
        self.wire.close()


__all__ = ["StreamMover", "StreamWire"]
