"""Prefill/decode disaggregation inside the engine: export a prefilled request's KV, import one.

Life of a disaggregated request:
  Prefill engine P (`KVConnector` attached, role "prefill"):
    1. `add_request(prompt, params, kv_transfer="export")`: a normal request with `export_kv` set.
    2. The scheduler prefills it (chunked as usual); the step that completes the prompt samples the
       first token with the request's own params and seeded generator.
    3. If that token ends the request (EOS, stop, max_tokens=1) it finishes as usual: nothing to export.
       Otherwise `export` takes it out of the batch without freeing its blocks: the transport leases
       them (`export(request_id, block_ids, num_tokens=len(prompt), state)`), copies a hybrid model's
       state (so the state slot is freed at once; over nixl, which registered the state slots, the
       slot is leased with the blocks instead, and the fetcher READs it) and returns a `KVHandle`.
       The request's final output carries `kv_transfer = KVExport(handle, generator_state)`.
    4. When D releases the lease, or nobody claims it within kv_lease_s, the transport calls `on_free`
       on one of its threads; the ids wait on a queue that `drain()` empties on the engine thread at
       the start of every `step()` (and when idle: `LLMEngine.free_released_kv`).
  Decode engine D:
    1. `prepare(spec)` (engine thread) builds the request as `add_request` would, with the seeded
       generator restored to where P left it; `try_reserve` allocates blocks for the prompt and a state
       slot (False, nothing held, when there is no room yet: the caller retries until its deadline).
       A handle stamped with another layout than ours reserves nothing: step 2 asks the peer why.
    2. `fetch(ticket)` (any thread but the engine's: it blocks on the network, bounded by the deadline)
       pulls the payload into the ticket's blocks (the first contact with P runs the handshake: layout
       and shared secret) and asks P to release, in the background, on success and on failure alike
       (P then frees at once rather than at lease expiry). It never raises.
    3. `complete(ticket)` (engine thread). Success: the state goes into the slot and the request joins
       the batch with num_computed_tokens = len(prompt) and output [first_token]; its next step computes
       the first token's KV, exactly as colocated. Failure: blocks and slot are freed, the failure is
       counted by kind, then the policy: "fail" raises `KVTransferFailed`; "recompute" queues it like a
       preempted request (prompt + first token recomputed here: the same output). A refused peer
       (layout or auth) always fails: a first token from another model cannot be continued.
    An abort between prepare and complete marks the ticket; complete (or discard) frees it.
"""

from __future__ import annotations

import hashlib
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import torch

from splitserve.engine.disagg_types import (
    ImportSpec,
    ImportTicket,
    KVExport,
    KVTransferFailed,
    NoRoom,
    payload_nbytes,
    restore_generator,
)
from splitserve.engine.params import SamplingParams
from splitserve.engine.request import Request, RequestOutput, Status, completion_of
from splitserve.kv import (
    AuthError,
    KVHandle,
    KVLayout,
    KVTransport,
    PeerRefused,
    TransferTimeout,
    TransportOptions,
    make_transport,
)
from splitserve.kv.layout import dtype_name

if TYPE_CHECKING:
    from splitserve.engine.engine import LLMEngine

log = logging.getLogger(__name__)

POLICIES = ("fail", "recompute")
REFUSALS = (PeerRefused, AuthError)  # configuration errors: never recomputed over


def engine_layout(engine: LLMEngine) -> KVLayout:
    """The layout two engines must share to exchange KV: weights fingerprint, KV and state shapes."""
    ckpt = engine.loaded.checkpoint
    if ckpt is not None:
        fingerprint = ckpt.fingerprint()
    else:  # random weights: the config is all there is to compare
        fingerprint = "config:" + hashlib.sha256(repr(engine.model_config).encode()).hexdigest()
    shapes = engine.loaded.model.state_shapes()
    states = [(name, tuple(shape), dtype_name(dtype)) for name, (shape, dtype) in shapes.items()]
    return KVLayout.from_tensor(engine.kv, fingerprint, states)


class KVConnector:
    """Joins an `LLMEngine` to a `KVTransport` (and sets itself as `engine.kv_connector`). Engine state
    is touched on the engine thread only, except by `fetch` (the transport and the ticket's own
    blocks) and `on_lease_end` (a queue)."""

    def __init__(
        self,
        engine: LLMEngine,
        transport: KVTransport | None = None,
        policy: str = "fail",
        fetch_timeout_s: float = 30.0,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown kv transfer policy {policy!r}; choose one of {POLICIES}")
        self.engine = engine
        self.layout = engine_layout(engine)
        self.transport = transport  # set after construction when it needs our on_lease_end
        self.policy = policy
        self.fetch_timeout_s = fetch_timeout_s
        self.counts: Counter[str] = Counter()  # exports, fetches, fetched_bytes, fetch_seconds, ...
        self.failures: Counter[str] = Counter()
        self._freed: queue.SimpleQueue[list[int]] = queue.SimpleQueue()
        # the transport reads state straight out of (and into) the engine's slots (register_states):
        # an export's slot is then held with its blocks, keyed by them, until the lease ends
        self.state_in_place = False
        self._leased_slots: dict[tuple[int, ...], int] = {}
        self._tickets: dict[str, ImportTicket] = {}
        self._lock = threading.Lock()  # guards counts written by fetch threads
        self._releaser = ThreadPoolExecutor(max_workers=2, thread_name_prefix="kv-release")
        engine.kv_connector = self

    @classmethod
    def open(
        cls,
        engine: LLMEngine,
        backend: str,
        *,
        secret: bytes | str | None = None,
        options: TransportOptions | None = None,
        policy: str = "fail",
        fallback: Sequence[str] = (),
    ) -> KVConnector:
        """A connector over a new transport of `backend` (or of the first usable one of `fallback`,
        logged and counted) for this engine's KV cache."""
        options = options or TransportOptions()
        conn = cls(engine, None, policy, options.fetch_timeout_s)
        conn.transport = make_transport(
            backend, engine.kv, conn.layout, secret=secret, on_free=conn.on_lease_end, options=options,
            fallback=fallback,
        )  # fmt: skip
        if engine.states.enabled:
            conn.state_in_place = conn.transport.register_states(engine.states.states)
        return conn

    # ---- prefill side ---------------------------------------------------------------------------

    def check_export(self, kv_transfer: str, params: SamplingParams) -> None:
        if kv_transfer != "export":
            raise ValueError(f"kv_transfer must be 'export' or None, got {kv_transfer!r}")
        if params.n != 1:
            raise ValueError("a request with n > 1 cannot be exported (its samples share one prompt)")
        if self.transport is None:
            raise ValueError("this engine's KV connector has no transport")

    def export(self, req: Request) -> None:
        """Engine thread, right after the first token: finish `req` with its blocks leased, not freed."""
        kv, sched = self.engine.scheduler.kv, self.engine.scheduler
        kv.cache_full_blocks(req)  # the prompt's full blocks stay findable here once the lease ends
        sched.detach(req)
        req.status = Status.FINISHED
        n = kv.blocks_for(req.num_prompt_tokens)
        leased, req.block_ids = req.block_ids[:n], req.block_ids[n:]
        state = None
        if req.state_slot is not None:
            state = {name: t[req.state_slot] for name, t in self.engine.states.states.items()}
        try:
            assert self.transport is not None
            handle = self.transport.export(req.request_id, leased, req.num_prompt_tokens, state)
        except Exception as exc:  # noqa: BLE001 - the request fails, its blocks come back
            log.error("kv export of %s failed: %s", req.request_id, exc)
            self._count("export_errors")
            req.block_ids = leased + req.block_ids
            req.finish_reason, req.stop_reason = "error", f"kv export failed: {exc}"
        else:
            gen_state = req.generator.get_state().numpy().tobytes() if req.generator is not None else None
            req.kv_export = KVExport(handle, gen_state)
            self._count("exports")
            self._count("exported_blocks", len(leased))
            if self.state_in_place and req.state_slot is not None:  # read where it is: freed by drain()
                self._leased_slots[tuple(leased)], req.state_slot = req.state_slot, None
        kv.free(req)  # the state slot (copied by export, unless leased), and any block past the prompt's

    def on_lease_end(self, block_ids: list[int]) -> None:
        """The transport's on_free, on any thread: hand the ids to the engine thread."""
        self._freed.put(list(block_ids))

    def drain(self) -> int:
        """Engine thread: give back the blocks of every lease that ended; -> how many blocks."""
        n = 0
        while True:
            try:
                ids = self._freed.get_nowait()
            except queue.Empty:
                break
            self.engine.pool.free(ids)
            slot = self._leased_slots.pop(tuple(ids), None)
            if slot is not None:
                self.engine.states.free(slot)
            n += len(ids)
        if n:
            self._count("lease_freed_blocks", n)
        return n

    # ---- decode side ----------------------------------------------------------------------------

    def importing(self, request_id: str) -> bool:
        return request_id in self._tickets

    def prepare(self, spec: ImportSpec) -> ImportTicket:
        """Engine thread: validate and build the request (not queued), and try to reserve room."""
        policy = spec.policy or self.policy
        if policy not in POLICIES:
            raise ValueError(f"unknown kv transfer policy {policy!r}; choose one of {POLICIES}")
        if spec.handle.num_tokens != len(spec.prompt_token_ids):
            raise ValueError(
                f"the handle holds KV for {spec.handle.num_tokens} tokens, the prompt has "
                f"{len(spec.prompt_token_ids)}: it was made for another prompt"
            )
        if not 0 <= spec.first_token < self.engine.model_config.vocab_size:
            raise ValueError(f"first_token {spec.first_token} is outside the vocabulary")
        req = self.engine.build_request(spec.prompt_token_ids, spec.params, spec.request_id)
        restore_generator(req, spec.generator_state, self.engine.model_config.vocab_size)
        timeout = spec.timeout_s if spec.timeout_s is not None else self.fetch_timeout_s
        ticket = ImportTicket(spec, req, policy, time.monotonic() + timeout)
        ticket.foreign = spec.handle.layout_fingerprint != self.layout.fingerprint
        self._tickets[req.request_id] = ticket
        self.try_reserve(ticket)
        return ticket

    def try_reserve(self, ticket: ImportTicket) -> bool:
        """Engine thread: blocks for the prompt and a state slot, all or nothing."""
        if not (ticket.reserved or ticket.aborted or ticket.foreign):
            kv = self.engine.scheduler.kv
            ticket.reserved = kv.allocate(ticket.request, ticket.request.num_prompt_tokens)
            if ticket.reserved and self.state_in_place and self.engine.device.type == "cuda":
                ticket.slot_zeroed = torch.cuda.Event()
                ticket.slot_zeroed.record()
        return ticket.reserved

    def fetch(self, ticket: ImportTicket) -> None:
        """Any thread but the engine's: fill the ticket's blocks from the exporter, then have the lease
        released. The outcome is left on the ticket (`error`, `state`); this never raises."""
        assert self.transport is not None
        handle, left = ticket.spec.handle, ticket.seconds_left()
        if ticket.aborted:
            pass  # complete() frees it; the lease is released below
        elif ticket.foreign:
            ticket.error = self._refusal(handle, max(left, 0.1))
        elif not ticket.reserved:
            ticket.error = NoRoom(f"no free KV blocks for {ticket.request.num_prompt_tokens} tokens in time")
        elif left <= 0:
            ticket.error = TransferTimeout("the import deadline passed before the fetch started")
        else:
            start = time.perf_counter()
            try:
                ids, into_state = ticket.request.block_ids, self._slot(ticket)
                ticket.state = self.transport.fetch(handle, ids, left, into_state=into_state)
            except Exception as exc:  # noqa: BLE001 - every failure follows the policy
                ticket.error = exc
            else:
                ticket.fetched_bytes = payload_nbytes(handle, ticket.state, self.engine.kv)
                self._count("fetches")
                self._count("fetched_bytes", ticket.fetched_bytes)
                self._count("fetch_seconds", time.perf_counter() - start)
        if not isinstance(ticket.error, REFUSALS):  # a refused peer would refuse the release too
            self._releaser.submit(self.transport.release, handle)

    def complete(self, ticket: ImportTicket) -> RequestOutput | None:
        """Engine thread: join the batch, or follow the policy. -> an output if the request already
        finished (aborted, or its first token ends it), else None: its outputs come from `step()`."""
        req = ticket.request
        self._tickets.pop(req.request_id, None)
        spec = ticket.spec
        # a copy may still be writing the blocks (TransportError.pending): they come back after it
        late = getattr(ticket.error, "pending", None)
        if ticket.aborted:
            self.engine.scheduler.kv.free(req, after=late)
            self._count("aborted_imports")
            req.status, req.finish_reason = Status.FINISHED, "abort"
            return _finished_output(req)
        if ticket.error is None:
            self._load_state(req, ticket.state)
            return self.engine.adopt(req, spec.first_token, spec.first_logprob, req.num_prompt_tokens)
        self.engine.scheduler.kv.free(req, after=late)
        kind = type(ticket.error).__name__
        with self._lock:
            self.failures[kind] += 1
        log.warning("kv import of %s failed (%s: %s); policy %s", req.request_id, kind, ticket.error,
                    ticket.policy)  # fmt: skip
        if ticket.policy == "recompute" and not isinstance(ticket.error, REFUSALS):
            self._count("recomputed")
            return self.engine.adopt(req, spec.first_token, spec.first_logprob, 0)
        self._count("failed")
        raise KVTransferFailed(req.request_id, ticket.error)

    def discard(self, ticket: ImportTicket) -> None:
        """Engine thread: the caller went away; free whatever the ticket holds."""
        if self._tickets.get(ticket.request.request_id) is ticket:
            ticket.aborted = True
            self.complete(ticket)

    def abort_import(self, request_id: str) -> bool:
        ticket = self._tickets.get(request_id)
        if ticket is not None:
            ticket.aborted = True  # its fetch may still be writing into the blocks: complete frees them
        return ticket is not None

    def import_blocking(self, spec: ImportSpec) -> RequestOutput | None:
        """The library path (LLMEngine.add_request_with_kv): all on the caller's thread. No room now
        counts as a failure (`NoRoom`): "recompute" then queues the request to wait for room."""
        ticket = self.prepare(spec)
        self.fetch(ticket)
        return self.complete(ticket)

    # ---- both -----------------------------------------------------------------------------------

    def check_peer(self, address: str, timeout_s: float = 5.0) -> KVLayout:
        """Connect (and handshake) with an exporter now; -> its layout. Raises PeerRefused / AuthError."""
        if self.transport is None:
            raise ValueError("no kv transport: cannot check a peer")
        return self.transport.check_peer(address, timeout_s)

    def _refusal(self, handle: KVHandle, timeout_s: float) -> BaseException:
        """Why a handle stamped with another layout cannot be fetched: the peer's own refusal, with
        every difference listed, when the handshake fails (it should); else the stamp itself."""
        try:
            self.check_peer(handle.address, timeout_s)
        except REFUSALS as exc:
            return exc
        except Exception as exc:  # noqa: BLE001 - unreachable: the stamp still says it all
            log.info("could not ask %s about its layout: %s", handle.address, exc)
        diff = f"layout_fingerprint: ours {self.layout.fingerprint}, handle {handle.layout_fingerprint}"
        return PeerRefused(f"handle {handle.request_id} was made for another KV layout", [diff])

    @property
    def backend_name(self) -> str | None:
        """The backend the transport actually runs (after any fallback), not the one asked for."""
        return self.transport.describe().get("backend") if self.transport is not None else None

    def stats(self) -> dict:
        with self._lock:
            counts, failures = dict(self.counts), dict(self.failures)
        desc = self.transport.describe() if self.transport is not None else {}
        return {
            "backend": desc.get("backend"),
            "policy": self.policy,
            "importing": len(self._tickets),
            "counts": counts,
            "failures": failures,
            "transport": desc,
        }

    def close(self) -> None:
        self._releaser.shutdown(wait=True, cancel_futures=False)
        if self.transport is not None:
            self.transport.close()

    def _slot(self, ticket: ImportTicket) -> dict[str, torch.Tensor] | None:
        """Fetch thread: views of the ticket's state slot, for a transport that writes it in place."""
        slot = ticket.request.state_slot
        if not self.state_in_place or slot is None:
            return None
        if ticket.slot_zeroed is not None:
            ticket.slot_zeroed.synchronize()  # NOTE: the engine's zero_() must not land after the READ
        return {name: t[slot] for name, t in self.engine.states.states.items()}

    def _load_state(self, req: Request, state: dict[str, torch.Tensor]) -> None:
        if req.state_slot is None:
            return
        for name, t in self.engine.states.states.items():  # t [num_slots, *shape]
            if state[name].data_ptr() != t[req.state_slot].data_ptr():  # not written in place
                t[req.state_slot].copy_(state[name])

    def _count(self, name: str, n: float = 1) -> None:
        with self._lock:
            self.counts[name] += n


def _finished_output(req: Request) -> RequestOutput:
    return RequestOutput(req.request_id, req.prompt_token_ids, [completion_of(req)], finished=True)


__all__ = [
    "POLICIES",
    "ImportSpec",
    "ImportTicket",
    "KVConnector",
    "KVExport",
    "KVTransferFailed",
    "NoRoom",
    "engine_layout",
]
