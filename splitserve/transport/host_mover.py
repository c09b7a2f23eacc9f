"""The part of a payload mover that tcp and shm share: the payload streams through the host on the
control connection (or beside it), the state travels as host copies, every fetch asks the exporter.

A mover (the contract in channel.py) built on it defines `backend`, `listen_spec`, `send_payload` and
`recv_payload`; it is a set of defaults, not a backend: tcp and shm each pick it, neither extends the
other."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from splitserve.transport.board import LeaseBoard
from splitserve.transport.client import SyncChannel
from splitserve.transport.handle import KVHandle
from splitserve.transport.payload import ByteStream, snapshot_state
from splitserve.transport.protocol import Deadline
from splitserve.transport.server import AsyncChannel

if TYPE_CHECKING:
    from splitserve.transport.channel import KVChannel


class HostStreamMover:
    """Defaults of a mover whose payload is streamed by the exporter on request (see the module)."""

    def bind(self, ch: KVChannel) -> None:
        self.ch, self.kv_cache, self.layout, self.options = ch, ch.kv_cache, ch.layout, ch.options

    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return False  # the state travels as host copies

    def make_board(self) -> LeaseBoard | None:
        return None  # every fetch asks the exporter

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
        return snapshot_state(self.layout, state)

    async def serve_op(self, chan: AsyncChannel, header: dict) -> bool | None:
        return None  # no open exchange

    def fetch(
        self,
        handle: KVHandle,
        into_block_ids: Sequence[int],
        timeout_s: float | None = None,
        into_state: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        return self.ch.stream_fetch(handle, into_block_ids, timeout_s, self.recv_payload)

    def recv_payload(self, chan: SyncChannel, stream: ByteStream, deadline: Deadline) -> dict:
        raise NotImplementedError

    def describe(self) -> dict:
        return {}

    def close(self) -> None:
        pass


__all__ = ["HostStreamMover"]
