"""LLMEngine: add_request / step / abort over the scheduler, the model runner and the sampler.

One `step()` = schedule -> run the model on the flat batch -> sample -> append tokens, check stop
conditions, cache full blocks, free finished requests -> return outputs for requests that changed.

Overlapped steps (`async_scheduling`, on by default on CUDA; overlap.py): in steady decode step N+1
is launched with step N's tokens still on the device, and N's tokens are read while N+1 runs.

Prefill/decode disaggregation (disagg.py) plugs in through `kv_connector`: `add_request(...,
kv_transfer="export")` leases a request's blocks to the KV transport after its first token instead of
freeing them; `add_request_with_kv(...)` starts a request whose prompt KV is fetched from a prefill
engine; blocks whose lease ended come back at the start of each `step()` (or `free_released_kv()`).

Constrained requests (`SamplingParams.grammar`, grammar.py) wait outside the scheduler while their
grammar compiles on a thread, are masked by it in the sampler and advance their matcher with each token.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections.abc import Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from typing import TYPE_CHECKING

import torch

from splitserve.engine.block_pool import BlockPool
from splitserve.engine.config import EngineConfig, allocate_kv_cache, block_bytes, kv_budget_bytes
from splitserve.engine.grammar import Grammars
from splitserve.engine.kv_manager import KVManager
from splitserve.engine.overlap import OverlappedSteps, _Inflight
from splitserve.engine.params import SamplingParams
from splitserve.engine.request import Request, RequestOutput, Status, TokenLogprob, completion_of
from splitserve.engine.runner import ModelRunner
from splitserve.engine.sampler import Sampler
from splitserve.engine.scheduler import Scheduler, SchedulerOutput
from splitserve.engine.state_cache import StateCheckpoints
from splitserve.engine.state_pool import StatePool
from splitserve.engine.stop import check_stop
from splitserve.model import cpu_linear
from splitserve.model.attention import (
    AttentionBackend,
    AttentionMetadata,
    PrefillBatch,
    PrefillChunk,
    TorchPagedAttention,
    TritonPagedAttention,
    triton_supported,
)
from splitserve.model.checkpoint import is_random_source
from splitserve.model.decoder import ForwardContext
from splitserve.model.gdn_prefill import resolve_backend as resolve_linear_backend
from splitserve.model.loader import LoadedModel, load_model, resolve_model_path
from splitserve.model.random_weights import random_model, random_source_config
from splitserve.model.tokenizer import Tokenizer, load_tokenizer

if TYPE_CHECKING:
    from splitserve.engine.disagg import KVConnector
    from splitserve.kv.handle import KVHandle

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
        self.device = config.torch_device()
        self.dtype = config.torch_dtype(self.device)
        if is_random_source(config.model):  # random weights at a named shape (benchmarks)
            path = str(config.model)
            self.loaded = loaded or random_model(
                random_source_config(path), self.device, self.dtype, config.resolve_max_model_len
            )
        else:
            path = resolve_model_path(config.model)
            self.loaded = loaded or load_model(
                path,
                self.device,
                self.dtype,
                config.resolve_max_model_len,
                progress=config.progress,
                weight_cache=config.weight_cache(),
            )
        self.model_path = path
        self.model_config = self.loaded.config
        self.max_model_len = config.resolve_max_model_len(self.model_config)
        if tokenizer is True:
            tokenizer = load_tokenizer(
                config.model, config.tokenizer, self.model_config.eos_token_ids, self.loaded.checkpoint
            )
        self.tokenizer: Tokenizer | None = tokenizer or None
        self.eos_token_ids = (
            self.tokenizer.eos_token_ids if self.tokenizer else self.model_config.eos_token_ids
        )
        self.block_size = config.block_size
        cfg = self.model_config
        attn = self._attention_backend()
        self._linear_attention_backend()
        if self.device.type == "cpu":
            counts = cpu_linear.prepare_model(self.loaded.model, config.cpu_weights)
            log.info("CPU projections (%s): %s", config.cpu_weights, counts)
        graphs = self.device.type == "cuda" and not config.enforce_eager and attn.batched_prefill
        if self.device.type == "cuda" and not graphs:
            log.info("decode CUDA graphs are off (enforce_eager or the torch attention backend)")
        layout = (cfg.num_kv_layers, 2, self.block_size, cfg.num_kv_heads, cfg.head_dim)  # of one block
        reserve = 0
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # Triton launches on the current device
                reserve = self._profile_run(attn, layout)
        budget = kv_budget_bytes(config, self.device, reserve)
        num_blocks = budget // block_bytes(cfg, self.block_size, self.dtype)
        # CUDA graphs: one block more, never handed out, for the padded rows of a graph step to write
        kv_shape = (num_blocks + int(graphs), *layout)
        self.kv = allocate_kv_cache(kv_shape, self.dtype, self.device, shared=config.kv_shared_memory)
        self.states = StatePool(
            self.loaded.model.state_shapes(), config.max_num_seqs, self.device, scratch_slot=graphs
        )
        prefix_caching = config.enable_prefix_caching
        checkpoints = None
        if prefix_caching and self.states.enabled:  # hybrid: prefixes end at recurrent-state checkpoints
            checkpoints = StateCheckpoints(
                self.loaded.model.state_shapes(), config.state_checkpoints, self.device
            )
            log.info("hybrid prefix caching: %d state checkpoints (%.2f GiB)", checkpoints.num_entries,
                     checkpoints.nbytes() / 2**30)  # fmt: skip
            prefix_caching = checkpoints.enabled
        self.pool = BlockPool(num_blocks, prefix_caching)
        self.scheduler = Scheduler(
            KVManager(self.pool, self.block_size, self.states, checkpoints),
            config.max_num_seqs,
            config.max_num_batched_tokens,
        )
        self.runner = ModelRunner(self.loaded.model, self.kv, attn, self.block_size, self.states.states)
        self.graph_capture_s = 0.0
        if graphs:
            self.graph_capture_s = self.runner.enable_cuda_graphs(
                config.max_num_seqs, self.max_model_len, num_blocks, self.states.scratch
            )
        self.sampler = Sampler(cfg.vocab_size, self.device, config.seed)
        hf = self.tokenizer.hf if self.tokenizer is not None else None
        self.grammars = Grammars(hf, cfg.vocab_size, self.eos_token_ids)
        self._compiling: list[tuple[Future, list[Request]]] = []  # waiting for their grammar
        self.requests: dict[str, Request] = {}
        self._parents: dict[str, list[Request]] = {}
        self.kv_connector: KVConnector | None = None  # set by disagg.KVConnector for the PD roles
        self._ready: list[RequestOutput] = []  # outputs made outside a step, returned by the next one
        overlap = config.async_scheduling
        self.async_scheduling = self.device.type == "cuda" if overlap is None else overlap
        self._inflight: _Inflight | None = None  # an overlapped step whose tokens are not read yet
        self.overlapped_steps = 0
        self.forward_steps = 0  # steps that ran the model (overlapped or not)
        self.step_seconds = 0.0  # host wall time inside step() (whatever it waited for)
        self._ids = itertools.count()
        log.info(
            "KV cache: %d blocks of %d tokens (%.2f GiB); attention: %s",
            num_blocks,
            self.block_size,
            self.kv.numel() * self.kv.element_size() / 2**30,
            type(attn).__name__,
        )

    def _attention_backend(self) -> AttentionBackend:
        cfg = self.model_config
        scale = cfg.head_dim**-0.5
        choice = self.config.attention_backend
        if choice not in ("auto", "torch", "triton"):
            raise ValueError(f"attention_backend must be auto, torch or triton, not {choice!r}")
        usable = triton_supported(self.device, cfg.head_dim)
        if choice == "triton" and not usable:
            raise ValueError(
                "attention_backend=triton needs CUDA, an importable triton and a power-of-two head_dim >= 16"
            )
        if choice == "triton" or (choice == "auto" and usable):
            enable = getattr(self.loaded.model, "enable_fused_kernels", None)
            if enable is not None and enable():
                log.info("fused Triton kernels on (RMSNorm + residual, q/k norm + rotary + KV store, SiLU)")
            return TritonPagedAttention(scale)
        return TorchPagedAttention(scale, fold_gqa=self.device.type == "cpu")

    def _linear_attention_backend(self) -> None:
        """Hybrid models: the prefill path of the linear-attention layers (before the warm-up pass, which
        then compiles and tunes its kernels)."""
        choose = getattr(self.loaded.model, "set_linear_attention_backend", None)
        if choose is None:
            return
        backend = resolve_linear_backend(self.config.linear_attention_backend, self.device)
        choose(backend)
        log.info("linear-attention prefill: %s", backend)

    def _profile_run(self, attn: AttentionBackend, block_layout: tuple[int, ...]) -> int:
        """CUDA: one forward pass over `max_num_batched_tokens` tokens (one prefill chunk, against a
        temporary cache just big enough) plus the LM head for `max_num_seqs` rows, before the KV cache
        exists; -> bytes to hold back from the KV budget for activations and the decode graphs."""
        cfg, config = self.model_config, self.config
        tokens = min(config.max_num_batched_tokens, self.max_model_len)
        blocks = -(-tokens // self.block_size)
        dev = self.device
        torch.cuda.synchronize(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        before = torch.cuda.memory_allocated(dev)
        kv = torch.zeros((blocks, *block_layout), dtype=self.dtype, device=dev)
        states = StatePool(self.loaded.model.state_shapes(), 1, dev)
        table = torch.arange(blocks, device=dev)
        positions = torch.arange(tokens, device=dev)
        meta = AttentionMetadata(
            slot_mapping=positions,
            num_decode_tokens=0,
            decode_groups=(),
            prefills=(PrefillChunk(0, tokens, tokens, None if attn.batched_prefill else table),),
            seq_slots=torch.zeros(1, dtype=torch.int64, device=dev) if states.enabled else None,
            prefill_batch=PrefillBatch(
                torch.zeros(1, dtype=torch.int64, device=dev),
                torch.full((1,), tokens, device=dev),
                torch.full((1,), tokens, device=dev),
                table[None],
                tokens,
            ),
        )
        model = self.loaded.model
        with torch.inference_mode():
            ids = torch.zeros(tokens, dtype=torch.int64, device=dev)
            hidden = model(ids, positions, ForwardContext(attn, meta, kv, states.states))
            rows = min(tokens, config.max_num_seqs)
            model.compute_logits(hidden[:rows])
        torch.cuda.synchronize(dev)
        scratch = kv.numel() * kv.element_size() + states.nbytes_per_slot()
        peak = torch.cuda.max_memory_allocated(dev) - before - scratch
        del kv, states, hidden
        torch.cuda.empty_cache()
        # the decode graphs keep their own logits ([max_num_seqs, vocab] fp32) and a small pool
        graphs = 2 * config.max_num_seqs * cfg.vocab_size * 4 + 256 * 2**20
        log.info("warm-up pass over %d tokens: %.2f GiB of activations at peak", tokens, peak / 2**30)
        return max(0, peak) + graphs

    # ---- requests -------------------------------------------------------------------------------

    def add_request(
        self,
        prompt: str | Sequence[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        kv_transfer: str | None = None,
    ) -> str:
        """`kv_transfer="export"` (prefill role): stop after the first token and lease the prompt's KV
        to the transport; the final output's `kv_transfer` holds the handle (disagg.py)."""
        params = params or SamplingParams()
        request_id = request_id if request_id is not None else f"req-{next(self._ids)}"
        self._check_free_id(request_id)
        if kv_transfer is not None:
            self._connector().check_export(kv_transfer, params)
        prompt_ids = self._prompt_ids(prompt)
        max_tokens = self._check_lengths(prompt_ids, params)
        compiled = self.grammars.compile(params.grammar) if params.grammar is not None else None
        if compiled is not None and compiled.done() and compiled.exception() is not None:
            raise compiled.exception()  # type: ignore[misc]  # a GrammarError (a ValueError)
        children = [self._child(request_id, prompt_ids, params, i, max_tokens) for i in range(params.n)]
        for child in children[1:]:
            child.leader = children[0]
        children[0].export_kv = kv_transfer == "export"
        self._parents[request_id] = children
        for child in children:
            self.requests[child.request_id] = child
        if compiled is not None and not compiled.done():
            self._compiling.append((compiled, children))  # queued by _admit_compiled once compiled
            return request_id
        for child in children:
            if compiled is not None:
                child.grammar = self.grammars.matcher(child.params.grammar, compiled.result())
            self.scheduler.add(child)
        return request_id

    def _admit_compiled(self) -> None:
        """Queue the requests whose grammar has compiled; one whose grammar failed (the front ends check
        specs first, so hardly ever) ends with "abort", reported by this step."""
        waiting: list[tuple[Future, list[Request]]] = []
        for fut, children in self._compiling:
            if not fut.done():
                waiting.append((fut, children))
                continue
            error = fut.exception()
            live = [c for c in children if not c.finished]  # not aborted while it compiled
            for child in live:
                if error is None:
                    child.grammar = self.grammars.matcher(child.params.grammar, fut.result())
                    self.scheduler.add(child)
                else:
                    child.status, child.finish_reason = Status.FINISHED, "abort"
            if error is not None and live:
                log.warning("grammar of %s failed to compile: %s", live[0].request_id, error)
                self._ready.append(self._output(live[0].parent_id or live[0].request_id))
        self._compiling = waiting

    def abort(self, request_id: str) -> None:
        """Stop a request (all its n samples) and free everything it holds. Unknown ids are ignored."""
        if self.kv_connector is not None:
            self.kv_connector.abort_import(request_id)  # a KV fetch in flight: freed when it ends
        for req in self._parents.pop(request_id, []):
            if not req.finished:
                req.status = Status.FINISHED
                req.finish_reason = "abort"
                self.scheduler.finish(req)
            self.requests.pop(req.request_id, None)

    def has_request(self, request_id: str) -> bool:
        return request_id in self._parents

    def has_unfinished_requests(self) -> bool:
        return bool(self._parents or self._ready)

    @property
    def num_unfinished_requests(self) -> int:
        return len(self._parents)

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
        inflight = self._inflight
        if inflight is not None and not self._may_continue():
            self._inflight = None
            return ready + self._resolve(inflight)  # read it now; the next step runs as usual
        sched = self.scheduler.schedule()
        if not sched.chunks:
            if self._compiling and not ready:  # nothing else to do: wait for a grammar, not spin
                wait([f for f, _ in self._compiling], timeout=0.005, return_when=FIRST_COMPLETED)
            return ready
        self.forward_steps += 1
        if inflight is not None or self._may_overlap(sched):  # overlap.py
            return ready + self._overlapped_step(sched, inflight)
        logits, sample_chunks = self.runner.execute(sched.chunks)
        reqs = [c.request for c in sample_chunks]
        tokens, logprobs = self.sampler(logits, reqs) if reqs else ([], [])
        return ready + self._update(sched, reqs, tokens, logprobs)

    def _update(
        self,
        sched: SchedulerOutput,
        reqs: list[Request],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
    ) -> list[RequestOutput]:
        for chunk in sched.chunks:
            chunk.request.num_computed_tokens += chunk.num_tokens
        return self._take_tokens(sched, reqs, tokens, logprobs)

    def _take_tokens(
        self,
        sched: SchedulerOutput,
        reqs: list[Request],
        tokens: list[int],
        logprobs: list[TokenLogprob | None],
    ) -> list[RequestOutput]:
        """Append each sampled token (stop checks, KV export), cache the blocks the step filled, and
        return the outputs of the requests that changed."""
        now = time.monotonic()
        changed: dict[str, None] = {}
        for req, token, lp in zip(reqs, tokens, logprobs, strict=True):
            req.first_token_time = req.first_token_time or now
            self._append_token(req, token, lp)
            changed[req.parent_id or req.request_id] = None
        for chunk in sched.chunks:
            if not chunk.request.finished:
                self.scheduler.kv.cache_full_blocks(chunk.request)
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
            self.scheduler.kv.cache_full_blocks(req)
            self.scheduler.finish(req)
        elif req.export_kv:
            self._connector().export(req)  # finished, its blocks leased instead of freed

    def _output(self, parent_id: str) -> RequestOutput:
        children = self._parents[parent_id]
        finished = all(c.finished for c in children)
        if finished:
            del self._parents[parent_id]
            for c in children:
                self.requests.pop(c.request_id, None)
        head = children[0]
        return RequestOutput(
            request_id=parent_id,
            prompt_token_ids=head.prompt_token_ids,
            outputs=[completion_of(c) for c in children],
            finished=finished,
            num_cached_tokens=head.num_cached_tokens,
            metrics={
                "arrival_time": head.arrival_time,
                "scheduled_time": head.scheduled_time,
                "first_token_time": head.first_token_time,
            },
            kv_transfer=head.kv_export,
        )

    # ---- prefill/decode disaggregation (the work is in disagg.py) -------------------------------

    def add_request_with_kv(
        self,
        handle: KVHandle,
        prompt_token_ids: Sequence[int],
        first_token: int,
        params: SamplingParams | None = None,
        request_id: str | None = None,
        **options: object,
    ) -> str:
        """Decode role: fetch the prompt's KV from the prefill engine named by `handle` (blocking, with
        a deadline) and continue as if this engine had prefilled it. A failed fetch follows the policy:
        "fail" raises `KVTransferFailed`, "recompute" recomputes the prompt here. `options`: see
        `disagg.ImportSpec` (generator_state, first_logprob, policy, timeout_s)."""
        from splitserve.engine.disagg import ImportSpec

        rid = request_id or handle.request_id
        spec = ImportSpec(handle, list(prompt_token_ids), int(first_token), params or SamplingParams(),
                          rid, **options)  # type: ignore[arg-type]  # fmt: skip
        out = self._connector().import_blocking(spec)
        if out is not None:  # already finished (its first token ends it): the next step() reports it
            self._ready.append(out)
        return rid

    def free_released_kv(self) -> int:
        """Give back the blocks of exports whose lease ended (released or expired); -> how many."""
        return self.kv_connector.drain() if self.kv_connector is not None else 0

    def build_request(self, prompt: Sequence[int], params: SamplingParams, request_id: str) -> Request:
        """One request (n == 1), validated as `add_request` does, but not queued (a KV import)."""
        if params.n != 1:
            raise ValueError("a request with n > 1 cannot take part in a KV transfer")
        self._check_free_id(request_id)
        prompt_ids = self._prompt_ids(prompt)
        max_tokens = self._check_lengths(prompt_ids, params)
        if params.grammar is not None:
            self.grammars.compile(params.grammar)  # started now, used by adopt after the fetch
        return self._child(request_id, prompt_ids, params, 0, max_tokens)

    def adopt(
        self, req: Request, first_token: int, logprob: TokenLogprob | None, num_computed_tokens: int
    ) -> RequestOutput | None:
        """Queue a request built by `build_request` (at the front: it has waited already) with its
        prompt's first `num_computed_tokens` tokens computed (KV fetched: all; recompute: 0) and its
        first token sampled elsewhere. -> its output if that token already ends it, else None."""
        self._check_free_id(req.request_id)
        if req.params.grammar is not None:
            try:  # the first token is replayed into a fresh matcher by _append_token below
                req.grammar = self.grammars.matcher(req.params.grammar)
            except BaseException:
                self.scheduler.kv.free(req)
                raise
        req.num_computed_tokens = num_computed_tokens
        self._parents[req.request_id] = [req]
        self.requests[req.request_id] = req
        self.scheduler.waiting.appendleft(req)
        req.first_token_time = time.monotonic()
        self._append_token(req, first_token, logprob)
        return self._output(req.request_id) if req.finished else None

    def _connector(self) -> KVConnector:
        if self.kv_connector is None:
            raise ValueError("this engine has no KV connector: start it with a prefill or decode role")
        return self.kv_connector

    def _check_free_id(self, request_id: str) -> None:
        importing = self.kv_connector is not None and self.kv_connector.importing(request_id)
        if request_id in self._parents or importing:
            raise ValueError(f"request id {request_id!r} is already in use")

    # ---- helpers --------------------------------------------------------------------------------

    def _prompt_ids(self, prompt: str | Sequence[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("this engine has no tokenizer: pass prompt token ids")
            ids = self.tokenizer.encode(prompt)
        else:
            ids = [int(t) for t in prompt]
        if not ids:
            raise ValueError("the prompt is empty")
        vocab = self.model_config.vocab_size
        if min(ids) < 0 or max(ids) >= vocab:
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        return ids

    def _check_lengths(self, prompt_ids: list[int], params: SamplingParams) -> int:
        n = len(prompt_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"the prompt has {n} tokens, but max_model_len is {self.max_model_len}: "
                "it must be shorter, to leave room for at least one generated token"
            )
        if -(-(n + 1) // self.block_size) > self.pool.num_blocks:
            raise ValueError(f"the prompt ({n} tokens) does not fit in the KV cache")
        # NOTE: capped by the whole KV pool too: a sequence that outgrew it would preempt itself forever
        room = min(self.max_model_len, self.pool.num_blocks * self.block_size) - n
        return room if params.max_tokens is None else min(params.max_tokens, room)

    def _child(
        self, parent_id: str, prompt_ids: list[int], params: SamplingParams, index: int, max_tokens: int
    ) -> Request:
        child_params = params.for_child(index) if params.n > 1 else params
        req = Request(
            request_id=parent_id if params.n == 1 else f"{parent_id}#{index}",
            prompt_token_ids=prompt_ids,
            params=child_params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            parent_id=parent_id if params.n > 1 else None,
            index=index,
        )
        if child_params.seed is not None:
            req.generator = torch.Generator(device=self.device)
            req.generator.manual_seed(child_params.seed)
        if self.tokenizer is not None and child_params.detokenize:
            req.detokenizer = self.tokenizer.decode_stream(child_params.skip_special_tokens)
        return req
