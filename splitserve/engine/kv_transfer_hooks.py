"""The hooks between the engine and a KV connector (KV transfer: prefill/decode disaggregation).

The engine owns every request, block and state slot; the connector owns the transport. The engine
calls the connector at three points and the connector answers through the engine's inbox; the
connector never schedules, allocates or frees anything (as vLLM's KVConnectorBase_V1 with
`request_finished -> delay_free_blocks` and the scheduler's `WAITING_FOR_REMOTE_KVS`):

  what the engine does (engine thread)            what the connector does
  ----------------------------------------------  ------------------------------------------------
  PREFILL SIDE
  a request with `export_kv` samples its first    `request_finished(req, block_ids, state)`: lease
  token and does not stop: it leaves the batch,   the prompt's blocks (and a copy of its state, or
  and the engine asks                             the slot itself when `holds_state`) to the
                                                  transport. -> the `KVExport` (handle + sampler
                                                  state) when it holds them; None when not. Raises
                                                  when the export failed.
  holds `block_ids` (and the slot, if             posts `LeaseEnded(block_ids)` once, on any thread,
  `holds_state`) under a lease while the export   when the lease ends (released by the decode side,
  is held; frees them when `LeaseEnded` comes     or expired)
  off the inbox (at the start of every step)
  DECODE SIDE
  a request whose prompt KV is elsewhere waits    `accepts(handle)`: False when the handle was made
  in `Status.WAITING_FOR_KV`; the scheduler       for another layout: the engine reserves nothing,
  polls it each step, without blocking, and       and the load below fails with the peer's refusal
  reserves its prompt's blocks and state slot
  when they are free; then the engine calls       `start_load(load)`: returns at once; fetches into
                                                  `load.block_ids` (and `load.state`, the slot's
                                                  views, when `holds_state`) on a thread of its
                                                  own, has the exporter release its lease (except
                                                  on a refusal), and posts exactly one
                                                  `LoadDone(request_id, ...)`, success or not
  takes `LoadDone` off the inbox: the request     -
  joins the batch (or follows its policy); the
  blocks of a failed load come back once
  `error.pending` (a late copy) has ended
  gives up on a handle it never loads (aborted    `discard(handle)`: have the exporter release the
  before room, no room before the deadline)       lease
  BOTH
  `count` / `count_failure`: the engine's side of the transfer counters (recomputed, failed, ...)

`Inbox` is the engine's: the connector posts to it from any thread; the engine drains it.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from splitserve.engine.request import Request
from splitserve.wire.kv_handle import KVHandle


@dataclass(frozen=True)
class LeaseEnded:
    """Posted by the connector: the lease on these blocks ended; the engine frees what it held."""

    block_ids: tuple[int, ...]


@dataclass(frozen=True)
class LoadDone:
    """Posted by the connector: the load of `request_id` ended. `error` None: the blocks (and the
    state) hold the prompt's KV; `state`: the fetched state when not written in place."""

    request_id: str
    error: BaseException | None = None
    state: dict[str, torch.Tensor] = field(default_factory=dict)
    nbytes: int = 0


@dataclass(frozen=True)
class KVLoad:
    """What the engine asks a connector to load: the handle, into which blocks, by when."""

    request_id: str
    handle: KVHandle
    block_ids: list[int]  # reserved by the engine; empty when `accepts(handle)` was False
    deadline: float  # time.monotonic()
    state: dict[str, torch.Tensor] | None = None  # the slot's views, when the connector holds_state
    ready: Any = None  # CUDA: an event after the slot's zeroing; a write into the slot waits on it


class Inbox:
    """Messages to the engine thread from any thread; `wake` (if set) is called after each post."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[object] = queue.SimpleQueue()
        self.wake: Callable[[], None] | None = None

    def post(self, message: object) -> None:
        self._queue.put(message)
        if self.wake is not None:
            self.wake()

    def get(self, timeout_s: float | None = None) -> object | None:
        """The next message, or None when none is there (after waiting up to `timeout_s`)."""
        if not timeout_s and self._queue.empty():
            return None  # the common case, every step: no exception raised and caught
        try:
            return self._queue.get(timeout=timeout_s) if timeout_s else self._queue.get_nowait()
        except queue.Empty:
            return None


class KVConnectorBase(Protocol):
    """The connector's side of the hooks above (kv_connector.KVConnector is the one implementation)."""

    policy: str  # an import's policy when its request names none: "fail" or "recompute"
    fetch_timeout_s: float  # an import's deadline (room + fetch) when its request names none
    holds_state: bool  # the transport reads and writes state in place: exports hold the slot

    def bind(self, inbox: Inbox) -> None:
        """Where to post `LeaseEnded` and `LoadDone` (called once, when the engine attaches it)."""
        ...

    def check_export(self, kv_transfer: str, n: int) -> None:
        """Raise ValueError if a request (`n` samples) cannot be exported."""
        ...

    def request_finished(
        self, req: Request, block_ids: list[int], state: dict[str, torch.Tensor] | None
    ) -> object | None:
        """Prefill side: lease `block_ids` (and `state`) -> a KVExport when held, else None."""
        ...

    def accepts(self, handle: KVHandle) -> bool:
        """Decode side: this engine can load `handle` (its layout is ours)."""
        ...

    def start_load(self, load: KVLoad) -> None:
        """Decode side: fetch in the background, post one `LoadDone`; never raises."""
        ...

    def discard(self, handle: KVHandle) -> None:
        """Decode side: `handle` will not be loaded; have its lease released."""
        ...

    def count(self, name: str, n: float = 1) -> None: ...

    def count_failure(self, kind: str) -> None: ...


__all__ = ["Inbox", "KVConnectorBase", "KVLoad", "LeaseEnded", "LoadDone"]
