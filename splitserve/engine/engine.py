"""LLMEngine: add_request / step / abort over the scheduler, the model runner and the sampler.

One `step()`: poll the inbox (the KV connector's messages, grammars compiled) -> schedule -> execute
(the model on the flat batch) -> sample -> `scheduler.update_from_output` (tokens appended, stop
checks, blocks cached, finished requests freed) -> the outputs of the requests that changed.

How a step runs is chosen once, at start (`_step_fn`): plain; overlapped (`async_scheduling`, on by
default on CUDA; overlap.py: in steady decode step N+1 is launched with step N's tokens still on the
device, and N's tokens are read while N+1 runs); or speculative (spec/verify.py: drafts proposed
before the schedule, verified where a step has any).

KV transfer (what disaggregated serving is built on): kv_transfer_hooks.py (the contract with a
connector), kv_transfer.py (the engine's side: `add_request(..., kv_transfer="export")`,
`import_request`, `add_request_with_kv`), kv_transfer_port.py (what the transfers may do to the
engine's requests), kv_connector.py (`KVConnector`: the hooks over a transport).

Constrained requests (`SamplingParams.grammar`, grammar.py) wait outside the scheduler while their
grammar compiles on a thread (grammar_wait.py; at most `grammar_timeout_s`: then they fail with
`GrammarTimeout`, taken by `take_grammar_failures`), are masked by it in the sampler and advance their
matcher with each token.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, wait
from typing import TYPE_CHECKING

from splitserve.config.engine import EngineConfig
from splitserve.engine.builder import build
from splitserve.engine.grammar import Grammars
from splitserve.engine.grammar_wait import GrammarWaits
from splitserve.engine.intake import RequestFactory
from splitserve.engine.kv_prefault import KVPrefault
from splitserve.engine.kv_transfer import BlockLease, ImportOutcome, KVTransfers
from splitserve.engine.kv_transfer_port import TransferPort
from splitserve.engine.kv_transfer_types import ImportSpec
from splitserve.engine.overlap import OverlappedSteps
from splitserve.engine.request import RequestOutput, Status
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.spec.mtp import MTPDrafter
from splitserve.engine.spec.verify import SpecDecoder, has_drafts
from splitserve.engine.stats import EngineStats, StepTokens
from splitserve.engine.table import RequestTable
from splitserve.model.loader import LoadedModel
from splitserve.model.tokenizer import Tokenizer
from splitserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from splitserve.engine.kv_transfer_hooks import KVConnectorBase
    from splitserve.wire.kv_handle import KVHandle

log = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tokenizer: Tokenizer | None | bool = True,
        loaded: LoadedModel | None = None,
    ) -> None:
        """`tokenizer`: True loads the checkpoint's; `loaded`: reuse weights already in memory."""
        self.config = config
        p = build(config, tokenizer, loaded)  # loading, backends, warm-up, KV sizing, graph capture
        self.device, self.dtype, self.loaded, self.model_path = p.device, p.dtype, p.loaded, p.model_path
        self.model_config, self.max_model_len = p.loaded.config, p.max_model_len
        self.tokenizer: Tokenizer | None = p.tokenizer
        self.eos_token_ids, self.block_size = p.eos_token_ids, config.block_size
        self.kv_cache, self.states, self.pool = p.kv_cache, p.states, p.pool  # KV, state slots, blocks
        self.state_shapes = p.state_shapes or {}  # (shape, dtype) of each state slot's tensors, by name
        self.scheduler, self.runner, self.graph_capture_s = p.scheduler, p.runner, p.graph_capture_s
        self.memory_plan = p.memory_plan  # CUDA: the worker's share, piece by piece (engine/memory_plan.py)
        cfg = self.model_config
        self.intake = RequestFactory(self.tokenizer, cfg.vocab_size, self.eos_token_ids, self.max_model_len,
                                     self.pool.num_blocks, self.block_size, self.device)  # fmt: skip
        self.sampler = Sampler(cfg.vocab_size, self.device, config.seed)
        tok = self.tokenizer  # its transformers tokenizer (`hf`) is loaded on the first grammar
        self.grammars = Grammars(None, cfg.vocab_size, self.eos_token_ids, (lambda: tok.hf) if tok else None,
                                 config.grammar_threads)  # fmt: skip
        self._compiling = GrammarWaits(self.grammars, config.grammar_timeout_s)  # waiting for a grammar
        self.table = RequestTable()  # unfinished requests, and the outputs due before the next step
        self.requests = self.table.requests  # every unfinished child request, by its id
        port = TransferPort(self.table, self.scheduler, self.intake, self.grammars)
        self.transfers = KVTransfers(port, self.scheduler, self.kv_cache, self.states, cfg.vocab_size,
                                     config.grammar_timeout_s)  # fmt: skip
        self.scheduler.on_export = self.transfers.export
        self.prefault = KVPrefault(self.kv_cache, self.pool)  # CPU: for a serving loop's idle turns
        mtp = MTPDrafter(p.mtp_head, p.loaded.model) if p.mtp_head is not None else None
        self.runner.keep_hidden = mtp is not None  # the drafter reads each step's hidden states
        self.spec = SpecDecoder.create(config.speculative_config, self.states.states, mtp)  # None: off
        if self.spec is not None:
            self.spec.attach(self.scheduler.block_manager)  # MTP: cached blocks without the head's K/V
        overlap = config.async_scheduling if config.tensor_parallel_size == 1 else False  # (nor verify steps)
        overlap = (self.device.type == "cuda" if overlap is None else overlap) and not self.spec
        self.overlap = OverlappedSteps(self.scheduler, self.runner, self.sampler, self.table,
                                       self.max_model_len, overlap, self.states.enabled)  # fmt: skip
        self._step_fn = self._spec_step if self.spec else self._plain_step
        self.async_scheduling = overlap
        self.forward_steps = 0  # steps that ran the model (overlapped or not)
        self.step_tokens = StepTokens()  # tokens per model step, in vLLM's iteration_tokens buckets
        self.step_seconds = 0.0  # host wall time inside step() (whatever it waited for)
        self._ids = itertools.count()

    @property
    def async_scheduling(self) -> bool:
        return self.overlap.enabled

    @async_scheduling.setter
    def async_scheduling(self, on: bool) -> None:
        """Overlapped steps on or off; off, the overlapped step function runs plain steps (once a pending
        step is read)."""
        self.overlap.enabled = on
        if on:
            self._step_fn = self._overlapped_step

    @property
    def overlapped_steps(self) -> int:
        return self.overlap.steps

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer: str | None = None,
    ) -> str:
        """`kv_transfer="export"` (prefill role): stop after the first token and lease the prompt's KV
        to the transport; the final output's `kv_export` holds the handle (kv_connector.py)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self.table.check_free(request_id)
        if kv_transfer is not None:
            self.transfers.check_export(kv_transfer, params)
        prompt_ids = self.intake.prompt_ids(prompt)
        max_tokens = self.intake.max_tokens(prompt_ids, params)
        compiled = self.grammars.compile(params.grammar) if params.grammar is not None else None
        if compiled is not None and compiled.done() and compiled.exception() is not None:
            raise compiled.exception()  # type: ignore[misc]  # a GrammarError (a ValueError)
        children = [self.intake.child(request_id, prompt_ids, params, i, max_tokens) for i in range(params.n)]
        for child in children[1:]:
            child.leader = children[0]
        children[0].export_kv = kv_transfer == "export"
        self.table.add(request_id, children)
        if compiled is not None and not compiled.done():
            self._compiling.add(compiled, children)  # queued by a step's poll once compiled
            return request_id
        try:
            for child in children:
                grammar = compiled.result() if compiled else None
                child.grammar = self.grammars.for_request(child.params, grammar, child.earlier_output)
        except ValueError:  # a GrammarError: a resumed answer its grammar refuses
            self.table.pop(request_id)
            raise
        for child in children:
            self.scheduler.add(child)
        return request_id

    def take_grammar_failures(self) -> list[tuple[str, Exception]]:
        """(request id, GrammarError or GrammarTimeout) of each request whose grammar failed since the
        last call; its output ended with "abort" (a serving core answers the failure instead)."""
        return self._compiling.take_failures()

    def abort(self, request_id: str) -> None:
        """Stop a request (all its n samples) and free everything it holds (a compile that no other
        request waits for is cancelled, if it has not started). Unknown ids are ignored."""
        children = self.table.pop(request_id)
        if any(c.grammar is None and c.params.grammar is not None for c in children):
            self._compiling.cancel_for(children)
        for req in children:
            if req.status is Status.WAITING_FOR_KV:
                self.transfers.abort(req)  # a load in flight: its blocks are freed when it ends
            elif not req.finished:
                req.status = Status.FINISHED
                req.finish_reason = "abort"
                self.scheduler.finish(req)

    def has_request(self, request_id: str) -> bool:
        return request_id in self.table

    def has_unfinished_requests(self) -> bool:
        return bool(self.table.parents or self.table.due)

    def waits_for_kv_only(self) -> bool:
        """Every unfinished request waits for its KV: a step has nothing to run until the inbox says so."""
        sched = self.scheduler
        return bool(sched.waiting_for_kv) and not (self.table.due or self._compiling or sched.has_work())

    @property
    def num_unfinished_requests(self) -> int:
        return len(self.table)

    def stats(self) -> EngineStats:
        """Queues, blocks, slots, steps and the prefix cache, as of now (leases that ended taken first)."""
        self.free_released_kv()
        steps = (self.forward_steps, self.overlap.steps, self.step_seconds, self.step_tokens)
        spec = self.spec.stats() if self.spec is not None else None
        return EngineStats.collect(self.scheduler, self.states, self.transfers, self.kv_cache,
                                   unfinished=len(self.table), steps=steps, spec=spec)  # fmt: skip

    def lease_blocks(self, n: int, *, touch: bool = False) -> BlockLease:
        """Lend `n` free blocks outside any request (the KV probe): `KVTransfers.lease_blocks`."""
        self.free_released_kv()
        return self.transfers.lease_blocks(n, touch)

    def release_blocks(self, lease: BlockLease) -> None:
        self.transfers.release_blocks(lease.block_ids)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Poll the inbox, then schedule -> execute -> sample -> update -> outputs (`_step_fn`). Outputs
        made since the last step come first; an imported request's first token goes out alone, before
        a forward pass (table.DueOutputs)."""
        t0 = time.perf_counter()
        try:
            self._poll()
            due, alone = self.table.due.take()
            if alone:
                return due
            try:
                return due + self._step_fn()
            except BaseException:
                self.table.due.put_back(due)  # the next step (or step_only) returns them
                raise
        finally:
            self.step_seconds += time.perf_counter() - t0

    def _poll(self) -> None:
        """The inbox: the connector's messages (leases ended, loads done, loads started for imports
        that have room now), then the requests whose grammar compiled; with nothing else to do, wait
        for a grammar a little (rather than spin)."""
        self.transfers.poll()
        if self._compiling:
            if not (self.table.due or self.scheduler.has_work()):
                wait(self._compiling.futures(), timeout=0.005, return_when=FIRST_COMPLETED)
            for rid, error in self._compiling.admit(self.scheduler.add):  # failed: ended with "abort"
                log.warning("grammar of %s failed: %s", rid, error)
                self.table.due.post(self.table.output(rid))

    def _schedule(self) -> SchedulerOutput | None:
        sched = self.scheduler.schedule()
        if not sched.chunks:
            return None
        self.forward_steps += 1
        self.step_tokens.add(sched.num_tokens)
        return sched

    def _plain_step(self) -> list[RequestOutput]:
        sched = self._schedule()
        return [] if sched is None else self._run(sched)

    def _run(self, sched: SchedulerOutput) -> list[RequestOutput]:
        logits, sample_chunks = self.runner.execute(sched.chunks)  # the model on the flat batch
        reqs = [c.request for c in sample_chunks]  # the chunks that reach their request's end
        tokens, logprobs = self.sampler(logits, reqs) if reqs else ([], [])
        changed = self.scheduler.update_from_output(sched, reqs, tokens, logprobs)
        return self.table.outputs(changed)

    def _spec_step(self) -> list[RequestOutput]:
        """Drafts proposed, then a step that verifies them or that the MTP head catches up on
        (spec/verify.py), else a plain one."""
        spec = self.spec
        assert spec is not None
        spec.propose(self.scheduler, self.max_model_len, self.runner)
        sched = self._schedule()
        if sched is None:
            return []
        if not (has_drafts(sched) or spec.catches_up(sched)):
            return self._run(sched)
        return self.table.outputs(spec.run(sched, self.runner, self.sampler, self.scheduler))

    def _overlapped_step(self) -> list[RequestOutput]:
        """Async scheduling (overlap.py): launch this step before the pending one is read, while it may."""
        overlap = self.overlap
        if overlap.pending is not None and not overlap.may_continue():
            return overlap.read()  # only the pending step's tokens; the next step runs as usual
        sched = self._schedule()
        if sched is None:
            return []
        if overlap.pending is None and not overlap.may_start(sched):
            return self._run(sched)
        return overlap.launch(sched)  # this one left pending, the previous one read meanwhile

    def step_only(self, request_ids: set[str]) -> list[RequestOutput]:
        """One step of these requests alone (the others wait, untouched), without overlap: after a step
        raised, this finds the request(s) it can be pinned on. Requests that finish here are removed."""
        keep = {id(c) for rid in request_ids for c in self.table.parents.get(rid, [])}
        overlap, self.overlap.enabled = self.overlap.enabled, False
        self.table.due.run_model_next()
        try:
            with self.scheduler.only(keep):
                return self.step()
        finally:
            self.overlap.enabled = overlap

    # ---- KV transfer (the engine's side is in kv_transfer.py) -----------------------------------

    def attach_kv_connector(self, connector: KVConnectorBase) -> None:
        """Call `connector`'s hooks from now on (kv_connector.KVConnector.open does this)."""
        self.transfers.attach(connector)

    def wake_on_kv(self, wake: Callable[[], None]) -> None:
        """Call `wake` (from any thread) whenever the connector posts to the inbox."""
        self.transfers.inbox.wake = wake

    def add_request_with_kv(
        self,
        handle: KVHandle,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        **options: object,
    ) -> str:
        """Decode role: fetch the prompt's KV from the engine named by `handle` (blocking, with a deadline)
        and continue as if this engine had prefilled it; a failed fetch follows the policy ("fail" raises
        `KVTransferFailed`). `options`: `ImportSpec`'s (generator_state, first_logprob, policy, timeout_s)."""
        rid = request_id or handle.request_id
        spec = ImportSpec(handle, list(prompt_token_ids), int(first_token), params or SamplingParams(),
                          rid, **options)  # type: ignore[arg-type]  # fmt: skip
        self.transfers.import_blocking(spec)  # an output already finished: the next step() reports it
        return rid

    def import_request(self, spec: ImportSpec) -> str:
        """Decode role, without blocking: the request waits in WAITING_FOR_KV (`take_import_outcomes`)."""
        return self.transfers.begin(spec).request_id

    def take_import_outcomes(self) -> list[ImportOutcome]:
        """The imports that ended (joined the batch, or failed) since the last call."""
        return self.transfers.take_outcomes()

    def free_released_kv(self) -> int:
        """Take the connector's messages (leases ended, loads done), start loads that have room now;
        -> how many blocks came back."""
        return self.transfers.poll()
