"""LLMEngine: add_request / step / abort over the scheduler, the model runner and the sampler.

One `step()` = schedule -> run the model on the flat batch -> sample -> append tokens, check stop
conditions, cache full blocks, free finished requests -> return outputs for requests that changed.

Overlapped steps (`async_scheduling`, on by default on CUDA; overlap.py): in steady decode step N+1
is launched with step N's tokens still on the device, and N's tokens are read while N+1 runs.

KV transfer (what disaggregated serving is built on) goes through hooks the engine owns: kv_transfer_hooks.py
(the contract), kv_transfer.py (the engine's side: `add_request(..., kv_transfer="export")`, `import_request`,
`add_request_with_kv`), kv_connector.py (`KVConnector`: the hooks over a transport). The connector's messages
come off the engine's inbox at the start of each `step()` (or `free_released_kv()`).

Constrained requests (`SamplingParams.grammar`, grammar.py) wait outside the scheduler while their
grammar compiles on a thread (at most `grammar_timeout_s`: then they fail with `GrammarTimeout`, taken
by `take_grammar_failures`), are masked by it in the sampler and advance their matcher with each token.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

from splitserve.config.engine import EngineConfig
from splitserve.engine.builder import build
from splitserve.engine.grammar import Grammars
from splitserve.engine.grammar_wait import GrammarWaits
from splitserve.engine.intake import RequestFactory
from splitserve.engine.kv_prefault import KVPrefault
from splitserve.engine.kv_transfer import BlockLease, ImportOutcome, KVTransfers
from splitserve.engine.kv_transfer_types import ImportSpec
from splitserve.engine.overlap import OverlappedSteps, _Inflight
from splitserve.engine.request import Request, RequestOutput, Status, output_of
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import SchedulerOutput
from splitserve.engine.spec.verify import SpecDecoder, has_drafts
from splitserve.engine.stats import EngineStats, StepTokens
from splitserve.engine.stop import check_stop
from splitserve.model.loader import LoadedModel
from splitserve.model.tokenizer import Tokenizer
from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from collections.abc import Callable

    from splitserve.engine.kv_transfer_hooks import KVConnectorBase
    from splitserve.wire.kv_handle import KVHandle

log = logging.getLogger(__name__)


class LLMEngine(OverlappedSteps):
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
        self.requests: dict[str, Request] = {}
        self._parents: dict[str, list[Request]] = {}
        self.transfers = KVTransfers(self, self.scheduler, self.kv_cache, self.states, cfg.vocab_size,
                                     config.grammar_timeout_s)  # fmt: skip
        self.prefault = KVPrefault(self.kv_cache, self.pool)  # CPU: for a serving loop's idle turns
        self._ready: list[RequestOutput] = []  # outputs made outside a step, returned by the next one
        self._first_due = False  # a KV import's first token is in _ready: the next step returns it alone
        self._ran_last = True  # the last step() ran the model (so a step returns _ready alone at most once)
        self.spec = SpecDecoder.create(config.speculative_config, self.states.states)  # None: off
        overlap = config.async_scheduling  # (verify steps do not overlap)
        self.async_scheduling = (self.device.type == "cuda" if overlap is None else overlap) and not self.spec
        self._inflight: _Inflight | None = None  # an overlapped step whose tokens are not read yet
        self.forward_steps = self.overlapped_steps = 0  # steps that ran the model; of them, overlapped
        self.step_tokens = StepTokens()  # tokens per model step, in vLLM's iteration_tokens buckets
        self.step_seconds = 0.0  # host wall time inside step() (whatever it waited for)
        self._ids = itertools.count()

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
        self._check_free_id(request_id)
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
        self._parents[request_id] = children
        for child in children:
            self.requests[child.request_id] = child
        if compiled is not None and not compiled.done():  # queued by _admit_compiled once compiled
            self._compiling.add(compiled, children)
            return request_id
        for child in children:
            if compiled is not None:
                child.grammar = self.grammars.matcher(child.params.grammar, compiled.result())
            self.scheduler.add(child)
        return request_id

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar has compiled. One whose grammar failed (the front ends check
        specs first, so hardly ever) or is still compiling at its deadline ends with "abort", reported
        by this step, and its failure is kept for `take_grammar_failures`."""
        for rid, error in self._compiling.admit(self.scheduler.add):
            log.warning("grammar of %s failed: %s", rid, error)
            self._ready.append(self._output(rid))

    def take_grammar_failures(self) -> list[tuple[str, Exception]]:
        """(request id, GrammarError or GrammarTimeout) of each request whose grammar failed since the
        last call; its output ended with "abort" (a serving core answers the failure instead)."""
        return self._compiling.take_failures()

    def grammar_compiling(self, req: Request) -> Future | None:
        """The compile `req`'s grammar still waits for, if any."""
        if req.params.grammar is None:
            return None
        fut = self.grammars.compile(req.params.grammar)
        return None if fut.done() else fut

    def abort(self, request_id: str) -> None:
        """Stop a request (all its n samples) and free everything it holds (a compile that no other
        request waits for is cancelled, if it has not started). Unknown ids are ignored."""
        children = self._parents.pop(request_id, [])
        if any(c.grammar is None and c.params.grammar is not None for c in children):
            self._compiling.cancel_for(children)
        for req in children:
            if req.status is Status.WAITING_FOR_KV:
                self.transfers.abort(req)  # a load in flight: its blocks are freed when it ends
            elif not req.finished:
                req.status = Status.FINISHED
                req.finish_reason = "abort"
                self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents or self._ready)

    def waits_for_kv_only(self) -> bool:
        """Every unfinished request waits for its KV: a step has nothing to run until the inbox says so."""
        sched = self.scheduler
        return bool(sched.waiting_for_kv) and not (self._ready or self._compiling or sched.has_work())

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

    def stats(self) -> EngineStats:
        """Queues, blocks, slots, steps and the prefix cache, as of now (leases that ended taken first)."""
        self.free_released_kv()
        steps = (self.forward_steps, self.overlapped_steps, self.step_seconds, self.step_tokens)
        spec = self.spec.stats() if self.spec is not None else None
        return EngineStats.collect(self.scheduler, self.states, self.transfers, self.kv_cache,
                                   unfinished=len(self._parents), steps=steps, spec=spec)  # fmt: skip

    def lease_blocks(self, n: int, *, touch: bool = False) -> BlockLease:
        """Lend `n` free blocks outside any request (the KV probe): `KVTransfers.lease_blocks`."""
        self.free_released_kv()
        return self.transfers.lease_blocks(n, touch)

    def release_blocks(self, lease: BlockLease) -> None:
        self.transfers.release_blocks(lease.block_ids)

    # ---- the step -------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        t0 = time.perf_counter()
        try:
            return self._step()
        finally:
            self.step_seconds += time.perf_counter() - t0

    def step_only(self, request_ids: set[str]) -> list[RequestOutput]:
        """One step of these requests alone (the others wait, untouched), without overlap: after a step
        raised, this finds the request(s) it can be pinned on. Requests that finish here are removed."""
        keep = {id(c) for rid in request_ids for c in self._parents.get(rid, [])}
        overlap, self.async_scheduling = self.async_scheduling, False
        self._ran_last = False  # this step runs the model, whatever is due
        try:
            with self.scheduler.only(keep):
                return self.step()
        finally:
            self.async_scheduling = overlap

    def _step(self) -> list[RequestOutput]:
        self.free_released_kv()
        if self._compiling:
            self._admit_compiled()
        ready, self._ready = self._ready, []
        first_due, self._first_due = self._first_due, False
        if first_due and self._ran_last:  # out now, not after a forward pass (TTFT); it runs next call
            self._ran_last = False
            return ready
        self._ran_last = True
        try:
            return ready + self._run_step(idle_wait=not ready)
        except BaseException:
            self._ready[:0] = ready  # due before this step: the next step (or step_only) returns them
            raise

    def _run_step(self, idle_wait: bool) -> list[RequestOutput]:
        inflight = self._inflight
        if inflight is not None and not self._may_continue():
            self._inflight = None
            return self._resolve(inflight)  # read it now; the next step runs as usual
        if self.spec is not None:
            self.spec.propose(self.scheduler, self.max_model_len)
        sched = self.scheduler.schedule()
        if not sched.chunks:
            if self._compiling and idle_wait:  # nothing else to do: wait for a grammar, not spin
                wait(self._compiling.futures(), timeout=0.005, return_when=FIRST_COMPLETED)
            return []
        self.forward_steps += 1
        self.step_tokens.add(sched.num_tokens)
        if self.spec is not None and has_drafts(sched):
            return self.spec.run(self, sched)  # verify the drafts (spec/verify.py)
        if inflight is not None or self._may_overlap(sched):  # overlap.py
            return self._overlapped_step(sched, inflight)
        logits, sample_chunks = self.runner.execute(sched.chunks)
        reqs = [c.request for c in sample_chunks]
        tokens, logprobs = self.sampler(logits, reqs) if reqs else ([], [])
        return self._update(sched, reqs, tokens, logprobs)

    def _update(self, sched: SchedulerOutput, reqs: list[Request], tokens: list[int],
                logprobs: list[TokenLogprob | None]) -> list[RequestOutput]:  # fmt: skip
        self.scheduler.advance(sched)
        return self._take_tokens(sched, reqs, tokens, logprobs)

    def _take_tokens(self, sched: SchedulerOutput, reqs: list[Request], tokens: list[int],
                     logprobs: list[TokenLogprob | None]) -> list[RequestOutput]:  # fmt: skip
        """Append each sampled token (stop checks, KV export), cache the blocks the step filled, and
        return the outputs of the requests that changed."""
        now = time.monotonic()
        changed: dict[str, None] = {}
        for req, token, lp in zip(reqs, tokens, logprobs, strict=True):
            req.first_token_time = req.first_token_time or now
            self._append_token(req, token, lp)
            changed[req.parent_id or req.request_id] = None
        self.scheduler.cache_filled_blocks(sched)
        return [self._output(pid) for pid in changed]

    def _append_token(self, req: Request, token: int, lp: TokenLogprob | None) -> None:
        req.output_token_ids.append(token)
        if lp is not None:
            req.logprobs.append(lp)
        if req.grammar is not None and not req.grammar.accept(token):
            log.warning("%s: token %d is outside its grammar", req.request_id, token)  # a bug if seen
        new_chars = 0
        if req.detokenizer is not None:
            new_chars = len(req.detokenizer.step(token))
            req.text = req.detokenizer.text
        reason = check_stop(req, token, self.max_model_len, new_chars)
        if reason is None and req.grammar is not None and req.grammar.terminated:
            reason = req.finish_reason = "stop"  # the grammar took a stop token (ignore_eos kept it)
        if reason is not None:
            req.status = Status.FINISHED
            self.scheduler.block_manager.cache_full_blocks(req)
            self.scheduler.finish(req)
        elif req.export_kv:
            self.transfers.export(req)  # finished, its prompt's blocks held if the connector leases them

    def _output(self, parent_id: str) -> RequestOutput:
        """The output of a request (all its n samples); a finished one is forgotten."""
        out = output_of(parent_id, children := self._parents[parent_id])
        if out.finished:
            del self._parents[parent_id]
            for c in children:
                self.requests.pop(c.request_id, None)
        return out

    # ---- KV transfer (the engine's side is in kv_transfer.py) -----------------------------------

    @property
    def kv_connector(self) -> KVConnectorBase | None:
        return self.transfers.connector

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

    def build_request(self, prompt: Sequence[int], params: SamplingParams, request_id: str) -> Request:
        """One request (n == 1), validated as `add_request` does, but not queued (a KV import)."""
        if params.n != 1:
            raise ValueError("a request with n > 1 cannot take part in a KV transfer")
        self._check_free_id(request_id)
        prompt_ids = self.intake.prompt_ids(prompt)
        max_tokens = self.intake.max_tokens(prompt_ids, params)
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # started now, used by adopt after the fetch
        return self.intake.child(request_id, prompt_ids, params, 0, max_tokens)

    def register(self, req: Request) -> None:
        """Count a request built by `build_request` as this engine's (unfinished) from now on."""
        self._parents[req.request_id] = [req]
        self.requests[req.request_id] = req

    def forget(self, request_id: str) -> None:
        """Drop a registered request that ended without an output (its import failed)."""
        self._parents.pop(request_id, None)
        self.requests.pop(request_id, None)

    def post_output(self, output: RequestOutput) -> None:
        """An output made outside a step: the next `step()` returns it."""
        self._ready.append(output)

    def adopt(self, req: Request, first_token: int, logprob: TokenLogprob | None, computed: int) -> None:
        """A request from `build_request` (registered here if it is not yet) whose KV wait ended: queue
        it first with its prompt's first `computed` tokens computed (KV loaded: all; recompute: 0) and its
        first token sampled elsewhere. The next step() returns that token's output before any forward
        pass (the stream's first line does not wait for the second token)."""
        if not any(c is req for c in self._parents.get(req.request_id, ())):
            self._check_free_id(req.request_id)
            self.register(req)
        if req.params.grammar is not None:  # the first token is replayed into a fresh matcher below
            req.grammar = self.grammars.matcher(req.params.grammar)
        self.scheduler.kv_loaded(req, computed)
        req.first_token_time = time.monotonic()
        self._append_token(req, first_token, logprob)
        self._ready.append(self._output(req.request_id))
        self._first_due = True

    def _check_free_id(self, request_id: str) -> None:
        if request_id in self._parents:
            raise ValueError(f"request id {request_id!r} is already in use")
