"""GpuLink: what one GPU backend adds to the GPU mover (mover.py): how the two GPUs are joined and how
the blocks cross. cuda_ipc.py maps the exporter's KV into the fetcher, whose GPU copies the blocks out
of it (the fetcher pulls); nccl.py joins the two GPUs in a two-rank NCCL group per connection, over
which the exporter sends (it pushes) and the fetcher receives.

The mover runs the protocol (the open exchange on a connection's first fetch, the fetch request, the
payload frame and state, "done") and keeps what both need: the device and side stream, the checks,
the counters. A link is called at the few points where the backends differ; where it has nothing to
do, its method answers None.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from splitserve.wire.transport_info import CudaIpcInfo, NcclInfo

if TYPE_CHECKING:
    from splitserve.transport.board import LeaseBoard
    from splitserve.transport.client import SyncChannel
    from splitserve.transport.frames import Fetch, Frame, GpuPayload
    from splitserve.transport.layout import KVLayout
    from splitserve.transport.port import MoverPort
    from splitserve.transport.protocol import Deadline
    from splitserve.transport.server import AsyncChannel, ListenSpec
    from splitserve.transport.transport import ExportRequest, TransportOptions, TransportStats
    from splitserve.wire.kv_handle import KVHandle


@dataclass(frozen=True)
class QueuedCopy:
    """Blocks a fetcher's GPU is copying: the source ids, how (`copy_blocks`' answer), and the CUDA
    event after the copy (None: it was synchronous, as on the CPU test doubles)."""

    src_ids: np.ndarray
    how: str
    done: Any


class GpuSide(Protocol):
    """What a link uses of the GPU mover that holds it (mover.py's GpuMover)."""

    port: MoverPort
    layout: KVLayout
    options: TransportOptions
    stats: TransportStats
    device: torch.device
    gpu: str  # this GPU's UUID
    rows: torch.Tensor  # the KV cache as one row of bytes per block
    gpu_counts: Counter[str]  # how the blocks moved, for describe()

    @property
    def on_cuda(self) -> bool: ...

    def on_device(self, after_current: bool = True) -> AbstractContextManager[None]:
        """Our GPU and the mover's side stream current (GpuMover.on_device)."""
        ...

    def sync_stream(self) -> None: ...

    def hand_over(self, exc: BaseException, done: Any) -> None: ...

    def check_ids(self, block_ids: Sequence[int], what: str) -> tuple[int, ...]: ...

    def peer(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> Any:
        """The link's peer on this connection (`attach` on its first use)."""
        ...


class Push(Protocol):
    """Exporter: the blocks of one fetch on their way out, queued before the answer goes out."""

    chunk_blocks: int  # the payload frame's blocks per message (nccl)

    def cancel(self) -> None:
        """The answer did not go out: drop what was queued."""
        ...

    async def finish(self, deadline: Deadline) -> None:
        """The answer went out: send the blocks and wait until they are sent."""
        ...


class GpuLink(Protocol):
    """A GPU backend's part of the GPU mover (the module docstring)."""

    backend: str  # the name handles carry
    open_frame: type[Frame]  # the fetcher's open request on a fresh connection
    payload_frame: type[GpuPayload]  # the exporter's answer to a fetch

    def bind(self, mover: GpuSide) -> None:
        """Once, when the channel is made: the mover's device, side stream, port and counters."""
        ...

    def listen_spec(self) -> ListenSpec: ...

    def make_board(self) -> LeaseBoard | None:
        """A lease board for one-sided reads (board.py), or None: every fetch asks the exporter."""
        ...

    def export(self, request: ExportRequest) -> KVHandle | None:
        """The link's own export (cuda_ipc: the state into its GPU arena), or None: the usual lease."""
        ...

    async def serve_open(self, chan: AsyncChannel, frame: Frame) -> None:
        """Exporter: answer the open request (PeerRefused: a peer it cannot pair with)."""
        ...

    def start_push(self, chan: AsyncChannel, block_ids: np.ndarray, request: Fetch) -> Push | None:
        """Exporter, on the server loop: the push of the fetch `request` asked for, or None where the
        fetcher copies the blocks itself."""
        ...

    def attach(self, chan: SyncChannel, handle: KVHandle, deadline: Deadline) -> Any:
        """Fetcher: the open exchange on a fresh connection; -> the peer (kept on chan; closed with it)."""
        ...

    def read(self, handle: KVHandle, into: np.ndarray, deadline: Deadline) -> dict[str, torch.Tensor] | None:
        """Fetcher: the fetch done without asking the exporter (cuda_ipc's one-sided read); -> the
        state, or None: ask the exporter."""
        ...

    def prefetch(self, peer: Any, handle: KVHandle, into: np.ndarray) -> QueuedCopy | None:
        """Fetcher: a copy that may start as soon as the request is out, before the answer."""
        ...

    def pull(
        self, chan: SyncChannel, peer: Any, meta: GpuPayload, src_ids: np.ndarray, into: np.ndarray,
        deadline: Deadline, early: QueuedCopy | None,
    ) -> dict[str, torch.Tensor] | None:  # fmt: skip
        """Fetcher: move the blocks into kv_cache[into], synchronized, within the deadline; -> the
        state when the answer names a row of the exporter's state arena (`meta.state_row`), else
        None (the state came on the control channel)."""
        ...

    def describe(self) -> CudaIpcInfo | NcclInfo: ...

    def close(self) -> None: ...


__all__ = ["GpuLink", "GpuSide", "Push", "QueuedCopy"]
