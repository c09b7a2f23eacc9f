"""One prefill rank's exports, served from that rank's own process, out of its own pool.

A replica at tensor_parallel_size n serves each rank's KV heads and state channels from the process
that holds them: every rank has its own transport (the configured backend over its own KV cache, its
own listener). Rank 0's is the engine's; rank r > 0 opens its own when rank 0's connector asks
(`RankExporter`, a thread of rank r's worker, on the connection read_orders.py keeps to rank 0), and
answers rank 0's orders over it:

    rank 0 (kv_ranks.py's `RemoteRank`)                    rank r > 0 (`RankExporter`)
    ExportOrder("open", reach, layout) ─────────────────▶ make_transport(...), listen()
                                       ◀───────────────── ExportDone(address, pid)
    ExportOrder("export", request, slot) ───────────────▶ lease the blocks, copy the slot's state
                                       ◀───────────────── ExportDone(shard: address, lease, layout)
                                       ◀───────────────── Freed(block ids)   (its lease ended)

Rank 0 sends an export's orders while its engine thread waits for the answers, so no step runs (and
no state slot changes) on any rank before each has copied its state. A rank's lease ends when the
decode side releases it at that rank's server, or on expiry; the rank then tells rank 0 (`Freed`), and
the engine frees the blocks once every rank's lease of them ended. When rank 0's connector closes
its connection, the rank closes its transport (every lease it still holds ends).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch

from splitserve.transport.backends import make_transport
from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.layout import KVLayout
from splitserve.transport.transport import KVTransport, TransportOptions
from splitserve.wire.kv_handle import KVHandle, KVShard
from splitserve.wire.ops import FaultKnobs
from splitserve.wire.transport_info import TransportInfo


@dataclass(frozen=True)
class ExportOrder:
    """One of rank 0's orders to a rank's exporter (`op`: open | export | release | describe | faults)."""

    seq: int
    op: str
    reach: object = None  # open: read_orders.Reach (backend, secret, options)
    layout: KVLayout | None = None  # open: this rank's layout
    kv_heads: tuple[int, ...] = ()  # open: the model's KV heads this rank holds
    request_id: str = ""
    block_ids: tuple[int, ...] = ()
    num_tokens: int = 0
    with_state: bool = False  # export: the request has state (a hybrid model's)
    slot: int | None = None  # export: its state slot; None with state: a probe (slot 0, copied)
    handle: KVHandle | None = None  # release: this rank's part of an export
    knobs: FaultKnobs | None = None  # faults: what to inject (None: stop)


@dataclass(frozen=True)
class ExportDone:
    """A rank's answer to one `ExportOrder`."""

    seq: int
    pid: int
    address: str | None = None
    shard: KVShard | None = None
    info: TransportInfo | None = None
    error: tuple[str, str] | None = None  # (class name, message)


@dataclass(frozen=True)
class Freed:
    """A rank's lease of these blocks ended (released or expired)."""

    block_ids: tuple[int, ...]


def rank_state(
    pool: Mapping[str, torch.Tensor], with_state: bool, slot: int | None
) -> dict[str, torch.Tensor] | None:
    """What one rank exports as state: its own slot's views, or (state that is no slot: a transport
    probe's) a copy of its slot 0, of its own shapes."""
    if not with_state or not pool:
        return None
    return {name: t[slot] if slot is not None else t[0].clone() for name, t in pool.items()}


def shard_of(handle: KVHandle, rank: int, kv_heads: tuple[int, ...]) -> KVShard:
    """Rank `rank`'s part of an export, from the handle its own transport made."""
    return KVShard(
        handle.address, handle.lease_id, handle.layout_fingerprint, handle.checksum, rank, kv_heads
    )


class RankExporter:
    """Rank r > 0: its transport over its own pool (`kv`, `states`), driven by rank 0's orders; `send`
    carries a lease's end back to rank 0."""

    def __init__(
        self,
        rank: int,
        kv: torch.Tensor,
        states: Mapping[str, torch.Tensor],
        send: Callable[[object], None],
    ) -> None:
        self.rank, self.kv, self.states, self.send = rank, kv, states, send
        self.kv_heads: tuple[int, ...] = ()
        self.transport: KVTransport | None = None

    def answer(self, order: ExportOrder) -> ExportDone:
        """Carry out `order` on this rank's transport; every failure goes back to rank 0."""
        try:
            with _on_device(self.kv.device):
                return self._answer(order)
        except Exception as exc:  # noqa: BLE001 - rank 0 raises it for the export
            return ExportDone(order.seq, os.getpid(), error=(type(exc).__name__, str(exc)))

    def _answer(self, order: ExportOrder) -> ExportDone:
        pid = os.getpid()
        if order.op == "open":
            return ExportDone(order.seq, pid, address=self._open(order))
        if self.transport is None:
            raise RuntimeError(f"rank {self.rank} has no exporter open")
        if order.op == "export":
            if self.kv.device.type == "cuda":  # the last step's writes into the pool, before the copy
                torch.cuda.synchronize(self.kv.device)
            state = rank_state(self.states, order.with_state, order.slot)
            made = self.transport.export(order.request_id, order.block_ids, order.num_tokens, state)
            return ExportDone(order.seq, pid, shard=shard_of(made, self.rank, self.kv_heads))
        if order.op == "release":
            assert order.handle is not None
            self.transport.release(order.handle)
        elif order.op == "describe":
            return ExportDone(order.seq, pid, address=self.transport.address, info=self.transport.describe())
        elif order.op == "faults":
            self.transport.install_faults(FaultPlan(order.knobs) if order.knobs is not None else None)
        else:
            raise ValueError(f"unknown export order {order.op!r}")
        return ExportDone(order.seq, pid)

    def _open(self, order: ExportOrder) -> str:
        reach, layout = order.reach, order.layout
        assert layout is not None
        self.close()
        self.kv_heads = order.kv_heads
        options = getattr(reach, "options", None)
        if isinstance(options, TransportOptions):  # every rank its own listener: the OS picks the port
            options = dataclasses.replace(options, port=0)
        self.transport = make_transport(
            reach.backend,  # type: ignore[attr-defined]
            self.kv,
            layout,
            secret=reach.secret,  # type: ignore[attr-defined]
            on_free=self._freed,
            options=options,  # type: ignore[arg-type]
        )
        return self.transport.listen()

    def _freed(self, block_ids: list[int]) -> None:
        with contextlib.suppress(OSError):  # rank 0's connector closed: nobody counts any more
            self.send(Freed(tuple(block_ids)))

    def close(self) -> None:
        transport, self.transport = self.transport, None
        if transport is not None:
            transport.close()


def _on_device(device: torch.device) -> contextlib.AbstractContextManager:
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


__all__ = ["ExportDone", "ExportOrder", "Freed", "RankExporter", "rank_state", "shard_of"]
