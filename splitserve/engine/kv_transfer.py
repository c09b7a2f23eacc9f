"""The engine's side of KV transfer (prefill/decode disaggregation), over a connector's hooks
(kv_transfer_hooks.py, where the contract is): what the engine holds under leases, the requests waiting
for their KV, and the inbox the connector posts to. Everything here runs on the engine thread.

  Prefill side: `export(req)` right after a request with `export_kv` sampled its first token and did
    not stop: it leaves the batch; the connector is asked (`request_finished`) whether it holds the
    prompt's blocks (and the state slot); held ones wait in `_held` until `LeaseEnded` comes off the
    inbox; the rest is freed at once. `lease_blocks` / `release_blocks` hold blocks the same way for
    the KV probe.
  Decode side: `begin(spec)` builds the request and puts it in WAITING_FOR_KV; `poll()` (at the start
    of every step) drains the inbox, then lets the scheduler reserve room for the waiting requests
    and starts their loads (`start_load`); a `LoadDone` joins its request to the batch, or follows its
    policy: "fail" ends it (`KVTransferFailed` in its outcome), "recompute" queues it like a preempted
    request (prompt + first token recomputed here: the same output). A refused peer (layout or auth)
    always fails. A request whose grammar is still compiling when its KV arrives waits (its blocks
    held) until it has, or fails with `GrammarTimeout` past the compile deadline: the step never waits
    for a compile. Each import ends with one `ImportOutcome` (`take_outcomes`); `import_blocking` is
    the library's path: all on the caller's thread, no room now counting as `NoRoom`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from splitserve.engine.grammar import GrammarTimeout
from splitserve.engine.kv_transfer_hooks import Inbox, KVConnectorBase, KVLoad, LeaseEnded, LoadDone
from splitserve.engine.kv_transfer_types import ImportSpec, KVTransferFailed, NoRoom, restore_generator
from splitserve.engine.request import KVWait, Request, RequestOutput, Status, completion_of
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.state_pool import StatePool
from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams
from splitserve.transport.errors import AuthError, PeerRefused

log = logging.getLogger(__name__)

POLICIES = ("fail", "recompute")
REFUSALS = (PeerRefused, AuthError)  # configuration errors: never recomputed over


class EnginePort(Protocol):
    """What the transfers may do to their engine (LLMEngine hands them a kv_transfer_port.TransferPort):
    requests are the engine's to build, count, queue and report."""

    def build_request(self, prompt: Sequence[int], params: SamplingParams, request_id: str) -> Request: ...

    def register(self, req: Request) -> None: ...

    def adopt(self, req: Request, first_token: int, logprob: TokenLogprob | None, computed: int) -> None: ...

    def forget(self, request_id: str) -> None: ...

    def post_output(self, output: RequestOutput) -> None: ...

    def grammar_compiling(self, req: Request) -> bool: ...

    def grammar_late(self, since: float, timeout_s: float) -> bool: ...


@dataclass(frozen=True)
class BlockLease:
    """Blocks an engine lends outside any request (`LLMEngine.lease_blocks`, for the KV probe): held
    until `release_blocks`, or until a KV export of them ends its lease (the connector's `LeaseEnded`)."""

    block_ids: list[int]
    num_tokens: int  # what the blocks hold, full
    nbytes: int
    state: dict[str, torch.Tensor] | None  # hybrid: a copy of one slot's state, what an export carries


@dataclass(frozen=True)
class ImportOutcome:
    """How an import ended: `error` None: the request joined the batch (or ended, aborted; its output
    comes from a step); else it failed (`KVTransferFailed`, or the error that refused it)."""

    request_id: str
    error: BaseException | None
    info: dict  # kv_wait_s, kv_fetch_s, kv_bytes, kv_error


@dataclass
class _Import:
    spec: ImportSpec
    request: Request
    policy: str
    deadline: float  # time.monotonic(): room and fetch by then
    start: float = field(default_factory=time.perf_counter)
    reserved_at: float | None = None
    aborted: bool = False


class KVTransfers:
    def __init__(self, port: EnginePort, scheduler: Scheduler, kv_cache: torch.Tensor, states: StatePool,
                 vocab_size: int, grammar_timeout_s: float = 30.0) -> None:  # fmt: skip
        self.port = port
        self.grammar_timeout_s = grammar_timeout_s
        self._after_grammar: dict[str, LoadDone] = {}  # loaded, waiting for their grammar to compile
        self.scheduler = scheduler
        self.kv_cache = kv_cache
        self.states = states
        self.device = kv_cache.device
        self.vocab_size = vocab_size
        self.connector: KVConnectorBase | None = None
        self.inbox = Inbox()
        self.imports: dict[str, _Import] = {}  # WAITING_FOR_KV, by request id
        self._held: dict[tuple[int, ...], int | None] = {}  # leased block ids -> the state slot held too
        self._outcomes: list[ImportOutcome] = []

    def attach(self, connector: KVConnectorBase) -> None:
        self.connector = connector
        connector.bind(self.inbox)

    def _conn(self) -> KVConnectorBase:
        if self.connector is None:
            raise ValueError("this engine has no KV connector: start it with a prefill or decode role")
        return self.connector

    @property
    def num_held_blocks(self) -> int:
        return sum(len(ids) for ids in self._held)

    # ---- prefill side ---------------------------------------------------------------------------

    def check_export(self, kv_transfer: str, params: SamplingParams) -> None:
        self._conn().check_export(kv_transfer, params.n)

    def export(self, req: Request) -> None:
        """Right after `req`'s first token: finish it with the prompt's blocks held if the connector
        leases them (and the state slot, if it reads state in place), the rest freed."""
        conn, block_manager = self._conn(), self.scheduler.block_manager
        block_manager.cache_full_blocks(req)  # the prompt's full blocks stay findable once the lease ends
        self.scheduler.detach(req)
        req.status = Status.FINISHED
        n = block_manager.blocks_for(req.num_prompt_tokens)
        leased, req.block_ids = req.block_ids[:n], req.block_ids[n:]
        state = None
        if req.state_slot is not None:
            state = {name: t[req.state_slot] for name, t in self.states.states.items()}
        try:
            export = conn.request_finished(req, leased, state)
        except Exception as exc:  # noqa: BLE001 - the request fails, its blocks come back
            log.error("kv export of %s failed: %s", req.request_id, exc)
            export = None
            req.finish_reason, req.stop_reason = "error", f"kv export failed: {exc}"
        if export is None:
            req.block_ids = leased + req.block_ids
        else:
            req.kv_export = export
            slot = None
            if conn.holds_state and req.state_slot is not None:  # read where it is: freed at lease end
                slot, req.state_slot = req.state_slot, None
            self._held[tuple(leased)] = slot
        block_manager.free(req)  # the state slot (copied by the export, unless held), blocks past the prompt

    def lease_blocks(self, n: int, touch: bool = False) -> BlockLease:
        """Hold `n` free blocks (their bytes as they are; `touch`: zeroed first, so their pages are in)
        until `release_blocks` or `LeaseEnded`; raises `NoRoom` if fewer are free."""
        pool, kv = self.scheduler.block_manager.pool, self.kv_cache
        if pool.num_free < n:
            raise NoRoom(f"only {pool.num_free} free blocks for {n}")
        ids = pool.allocate(n)
        self._held[tuple(ids)] = None
        if touch:
            for i in ids:
                kv[i].zero_()
        state = {name: t[0].clone() for name, t in self.states.states.items()} or None
        nbytes = n * kv[0].numel() * kv.element_size()
        return BlockLease(ids, n * self.scheduler.block_manager.block_size, nbytes, state)

    def release_blocks(self, block_ids: Sequence[int]) -> int:
        """Free blocks held under a lease (and the state slot held with them); -> how many blocks."""
        key = tuple(block_ids)
        if key not in self._held:  # the same blocks in another order
            key = next((k for k in self._held if sorted(k) == sorted(key)), key)
        slot = self._held.pop(key, -1)
        if slot == -1:
            log.warning("blocks %s were not held under a lease: left alone", list(block_ids)[:8])
            return 0
        self.scheduler.block_manager.pool.free(block_ids)
        if slot is not None:
            self.states.free(slot)
        return len(block_ids)

    # ---- decode side ----------------------------------------------------------------------------

    def begin(self, spec: ImportSpec, wait_for_room: bool = True) -> Request:
        """Validate and build the request, and put it in WAITING_FOR_KV (its room and load come with
        the next `poll`). `wait_for_room` False: no room at that poll fails it as `NoRoom`."""
        conn = self._conn()
        policy = spec.policy or conn.policy
        if policy not in POLICIES:
            raise ValueError(f"unknown kv transfer policy {policy!r}; choose one of {POLICIES}")
        if spec.handle.num_tokens != len(spec.prompt_token_ids):
            raise ValueError(
                f"the handle holds KV for {spec.handle.num_tokens} tokens, the prompt has "
                f"{len(spec.prompt_token_ids)}: it was made for another prompt"
            )
        if not 0 <= spec.first_token < self.vocab_size:
            raise ValueError(f"first_token {spec.first_token} is outside the vocabulary")
        req = self.port.build_request(spec.prompt_token_ids, spec.params, spec.request_id)
        restore_generator(req, spec.generator_state, self.vocab_size)
        now = time.monotonic()
        deadline = now + (spec.timeout_s if spec.timeout_s is not None else conn.fetch_timeout_s)
        req.kv_wait = KVWait(deadline if wait_for_room else now, needs_room=conn.accepts(spec.handle))
        self.imports[req.request_id] = _Import(spec, req, policy, deadline)
        self.port.register(req)
        self.scheduler.wait_for_kv(req)
        return req

    def poll(self) -> int:
        """At the start of every step, without blocking: what the connector posted, then room for the
        requests waiting for their KV and their loads started. -> blocks freed by ended leases."""
        freed = 0
        while (msg := self.inbox.get()) is not None:
            freed += self._handle(msg)
        if self._after_grammar:
            self._grammar_due()
        if self.scheduler.waiting_for_kv:
            ready, late = self.scheduler.poll_kv()
            for req in ready:
                self._start(self.imports[req.request_id])
            for req in late:
                imp = self.imports[req.request_id]
                self._conn().discard(imp.spec.handle)
                err = NoRoom(f"no free KV blocks for {req.num_prompt_tokens} tokens in time")
                self._complete(imp, LoadDone(req.request_id, err))
        return freed

    def abort(self, req: Request) -> None:
        """Abort a request waiting for its KV: ended now if its load has not started, else marked (its
        blocks are freed when the load ends: it may still be writing them)."""
        imp = self.imports[req.request_id]
        imp.aborted = True
        if req.kv_wait is None or not req.kv_wait.loading:
            self._conn().discard(imp.spec.handle)
            self._complete(imp, LoadDone(req.request_id))

    def take_outcomes(self) -> list[ImportOutcome]:
        out, self._outcomes = self._outcomes, []
        return out

    def import_blocking(self, spec: ImportSpec) -> None:
        """The library path (LLMEngine.add_request_with_kv): on the caller's thread until the import
        ends; raises its failure. No room now counts as a failure (`NoRoom`)."""
        rid = self.begin(spec, wait_for_room=False).request_id
        self.poll()
        while rid in self.imports:
            self._grammar_due()
            msg = self.inbox.get(timeout_s=0.1)
            if msg is not None:
                self._handle(msg)
        mine = [o for o in self._outcomes if o.request_id == rid]
        self._outcomes = [o for o in self._outcomes if o.request_id != rid]
        if mine and mine[-1].error is not None:
            raise mine[-1].error

    # ---- the inbox ------------------------------------------------------------------------------

    def _handle(self, msg: object) -> int:
        if isinstance(msg, LeaseEnded):
            n = self.release_blocks(msg.block_ids)
            if n and self.connector is not None:
                self.connector.count("lease_freed_blocks", n)
            return n
        if isinstance(msg, LoadDone):
            imp = self.imports.get(msg.request_id)
            if imp is None:
                log.warning("a load of %s ended, but no import waits for it", msg.request_id)
            else:
                self._complete(imp, msg)
        return 0

    def _start(self, imp: _Import) -> None:
        req, conn = imp.request, self._conn()
        imp.reserved_at = time.perf_counter()
        state = ready = None
        if conn.holds_state and req.state_slot is not None:  # the load writes the slot in place
            state = {name: t[req.state_slot] for name, t in self.states.states.items()}
            if self.device.type == "cuda":  # after the slot's zeroing, which the write must not precede
                ready = torch.cuda.Event()
                ready.record()
        load = KVLoad(req.request_id, imp.spec.handle, list(req.block_ids), imp.deadline, state, ready)
        conn.start_load(load)

    def _grammar_due(self) -> None:
        """Adopt the loaded requests whose grammar has compiled (or was aborted); fail those past the
        compile deadline, their blocks freed."""
        for rid, done in list(self._after_grammar.items()):
            imp = self.imports[rid]
            compiling = self.port.grammar_compiling(imp.request)
            since = time.monotonic() - (time.perf_counter() - imp.start)  # the compile clock's time
            late = self.port.grammar_late(since, self.grammar_timeout_s)
            if compiling and not late and not imp.aborted:
                continue
            del self._after_grammar[rid]
            if imp.aborted or not compiling:
                self._complete(imp, done)
                continue
            del self.imports[rid]
            self.scheduler.block_manager.free(imp.request)
            error = GrammarTimeout(f"the grammar did not compile within {self.grammar_timeout_s:g} s")
            self._fail(imp.request, error, {"kv_bytes": done.nbytes})

    def _complete(self, imp: _Import, done: LoadDone) -> None:
        req, spec, error = imp.request, imp.spec, done.error
        rid = req.request_id
        if error is None and not imp.aborted and self.port.grammar_compiling(req):
            self._after_grammar[rid] = done  # adopted by a later poll, once compiled: never waited for
            return
        del self.imports[rid]
        start = imp.reserved_at or imp.start
        info = {
            "kv_wait_s": start - imp.start,
            "kv_fetch_s": time.perf_counter() - start,
            "kv_bytes": done.nbytes,
            "kv_error": None if error is None else type(error).__name__,
        }
        conn = self._conn()
        late = getattr(error, "pending", None)  # a copy may still write the blocks: freed after it
        if imp.aborted:
            self.scheduler.finish(req, after=late)
            conn.count("aborted_imports")
            req.status, req.finish_reason = Status.FINISHED, "abort"
            self.port.post_output(RequestOutput(rid, req.prompt_token_ids, [completion_of(req)], True))
            self._outcomes.append(ImportOutcome(rid, None, info))
            return
        computed = req.num_prompt_tokens
        if error is not None:
            self.scheduler.block_manager.free(req, after=late)
            conn.count_failure(type(error).__name__)
            log.warning("kv import of %s failed (%s: %s); policy %s", rid, type(error).__name__, error,
                        imp.policy)  # fmt: skip
            if imp.policy != "recompute" or isinstance(error, REFUSALS):
                conn.count("failed")
                self._fail(req, KVTransferFailed(rid, error), info)
                return
            conn.count("recomputed")
            conn.count("recomputed_tokens", req.num_prompt_tokens)
            computed = 0
        else:
            conn.count("imported_tokens", req.num_prompt_tokens)
        try:
            if error is None:
                self._load_state(req, done.state)
            self.port.adopt(req, spec.first_token, spec.first_logprob, computed)
        except Exception as exc:  # noqa: BLE001 - its grammar (or its state) failed: the import fails
            self.scheduler.block_manager.free(req)
            self._fail(req, exc, info)
            return
        self._outcomes.append(ImportOutcome(rid, None, info))

    def _fail(self, req: Request, error: BaseException, info: dict) -> None:
        self.scheduler.detach(req)
        req.status, req.finish_reason = Status.FINISHED, "error"
        self.port.forget(req.request_id)
        self._outcomes.append(ImportOutcome(req.request_id, error, info))

    def _load_state(self, req: Request, state: dict[str, torch.Tensor]) -> None:
        if req.state_slot is None:
            return
        for name, t in self.states.states.items():  # t [num_slots, *shape]
            if state[name].data_ptr() != t[req.state_slot].data_ptr():  # not written in place
                t[req.state_slot].copy_(state[name])
        put_ranks = getattr(self.states, "put_ranks", None)  # tensor parallel: the other ranks' parts
        if put_ranks is not None:
            put_ranks(req.state_slot, state)


__all__ = ["POLICIES", "REFUSALS", "BlockLease", "EnginePort", "ImportOutcome", "KVTransfers"]
