"""The exporter's side of a fetch: the requests a fetcher sends over the control channel (channel.py), one
at a time from the server loop (server.py's `RequestHandler`), and `Export`, what a lease keeps for them.

A request goes to the mover first (`serve_op`: a backend's own exchange, such as cuda_ipc's open); else
a fetch pins its lease (so it cannot end mid-read), draws a fault from the plan when one is installed
(tests only), and has the mover send the blocks (`send_payload`); a release ends the lease.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import torch

from splitserve.transport.errors import LeaseExpired, TransportError, UnknownLease
from splitserve.transport.fault_plan import Fault, FaultPlan
from splitserve.transport.frames import Error, Fetch, Frame, Ok, Release, op
from splitserve.transport.lease import LeaseManager
from splitserve.transport.protocol import Deadline
from splitserve.transport.server import AsyncChannel
from splitserve.transport.trace import mark
from splitserve.transport.transport import TransportOptions, TransportStats

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Export:
    """What the exporter keeps under a lease besides the block ids."""

    request_id: str
    state: dict[str, torch.Tensor]
    checksum: str | None
    state_row: int | None = None  # cuda_ipc: the state waits in this row of the exporter's arena


@dataclass(frozen=True)
class PayloadCall:
    """One fetch for a mover to answer (`send_payload`): the fetcher's connection, what the pinned
    lease keeps (its checksum goes in the payload frame), its block ids, the fault drawn from the plan
    (tests; `Fault.NONE` in production), the fetch's deadline, the plan, and the fetcher's request (a
    backend's own fields, such as nccl's `into_run`)."""

    chan: AsyncChannel
    export: Export
    block_ids: tuple[int, ...]
    fault: Fault
    deadline: Deadline
    request: Fetch
    plan: FaultPlan | None = None  # the plan `fault` was drawn from (tests; None in production)

    def unpack(self) -> tuple[AsyncChannel, Export, tuple[int, ...], Fault, Deadline]:
        return self.chan, self.export, self.block_ids, self.fault, self.deadline


class ServingMover(Protocol):
    """What the exporter's requests use of a mover (channel.py's `PayloadMover` has the whole contract)."""

    async def serve_op(self, chan: AsyncChannel, frame: Frame) -> bool | None: ...

    async def send_payload(self, call: PayloadCall) -> int: ...


class ExportRequests:
    """Serves a fetcher's requests for the leases of one exporter."""

    def __init__(
        self,
        mover: ServingMover,
        leases: LeaseManager,
        options: TransportOptions,
        stats: TransportStats,
        faults: Callable[[], FaultPlan | None],
    ) -> None:
        self.mover = mover
        self.leases = leases
        self.options = options
        self.stats = stats
        self.faults = faults  # the fault plan installed now (tests only: None in production)

    async def handle(self, chan: AsyncChannel, frame: Frame) -> bool:
        """Server loop: serve one request (RequestHandler); the mover's own ops first."""
        served = await self.mover.serve_op(chan, frame)
        if served is not None:
            return served
        if isinstance(frame, Fetch):
            return await self._serve_fetch(chan, frame)
        if isinstance(frame, Release):
            released = self.leases.release(frame.lease_id)
            await chan.send(Ok(released=released), Deadline.after(self.options.connect_timeout_s))
            return True
        if isinstance(frame, Error):
            log.warning("kv fetcher %s refused us: %s", chan.peer, frame.message)
            return False
        bad = TransportError(f"unexpected request {op(frame)!r}")
        await chan.send(Error.of(bad), Deadline.after(self.options.connect_timeout_s))
        return False

    async def _serve_fetch(self, chan: AsyncChannel, request: Fetch) -> bool:
        mark("e.request")
        deadline = Deadline.after(min(max(request.timeout_s, 0.001), self.options.max_fetch_s))
        try:
            with self.leases.pinned(request.lease_id) as lease:
                plan = self.faults()  # tests only: None in production
                fault = plan.draw() if plan is not None else Fault.NONE
                if fault is Fault.DROP:  # never answer; hold on until the fetcher gives up
                    await chan.wait_closed(Deadline.after(self.options.idle_timeout_s))
                    return False
                if fault is Fault.DELAY and plan is not None:
                    await asyncio.sleep(plan.knobs.delay_s)
                start = time.perf_counter()
                call = PayloadCall(chan, lease.payload, lease.block_ids, fault, deadline, request, plan)
                nbytes = await self.mover.send_payload(call)
                self.stats.served(nbytes, time.perf_counter() - start)
                return fault is not Fault.KILL
        except (LeaseExpired, UnknownLease) as exc:
            self.stats.error(exc)
            await chan.send(Error.of(exc), deadline)
            return True
        except (TransportError, ConnectionError):
            self.stats.count("serve_failures")
            raise


__all__ = ["Export", "ExportRequests", "PayloadCall", "ServingMover"]
