"""HostStream: the part of a payload mover that tcp and shm share, a component each of them holds
(`self.stream`); neither subclasses it or the other. The payload streams through the host on the
control connection (or beside it), the state travels as host copies, every fetch asks the exporter.

A stream mover (the contract in channel.py) defines `backend`, `listen_spec`, `send_payload` and
`recv_payload`, and hands `export`, `keep_state` and `fetch` to its HostStream."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING

import torch

from splitserve.transport.client import SyncChannel
from splitserve.transport.handle import KVHandle
from splitserve.transport.payload import ByteStream, snapshot_state
from splitserve.transport.protocol import Deadline

if TYPE_CHECKING:
    from splitserve.transport.channel import KVChannel

RecvPayload = Callable[[SyncChannel, ByteStream, Deadline], dict]


class HostStream:
    """Export under the channel's lease, keep host copies of the state, fetch by asking the exporter
    and letting the mover's `recv_payload` fill our blocks' views (see the module)."""

    def __init__(self, recv_payload: RecvPayload) -> None:
        self.recv_payload = recv_payload

    def bind(self, ch: KVChannel) -> None:
        self.ch = ch

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

    def fetch(
        self, handle: KVHandle, into_block_ids: Sequence[int], timeout_s: float | None = None
    ) -> dict[str, torch.Tensor]:
        return self.ch.stream_fetch(handle, into_block_ids, timeout_s, self.recv_payload)


__all__ = ["HostStream", "RecvPayload"]
