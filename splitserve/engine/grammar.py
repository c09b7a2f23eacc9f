"""Grammar-constrained decoding with xgrammar: compile a request's `GrammarSpec`, follow its tokens with
a matcher, and mask the logits of the tokens the grammar does not allow next.

A constrained request's life in the engine:
  1. `add_request` (or `build_request`, for a KV import) asks `Grammars.compile(spec)` for the compiled
     grammar: a Future, done at once when the spec was compiled before (cached per spec), else compiled
     in a small pool of threads (xgrammar releases the GIL while it compiles); the request waits outside
     the scheduler, holding no KV, until it is done (grammar_wait.py; a KV import waits
     after its load, `KVTransfers`), so a slow compile never stalls the step that runs the other
     requests. Past the compile deadline it fails with `GrammarTimeout` (a 503); the compile goes on
     and its result stays cached. A request aborted while it waits cancels its compile if no other
     request waits for it and it has not started.
  2. Each step that samples it, the sampler masks its logits (`mask_logits`): one token bitmask (int32,
     one bit per token; on CUDA [N, ceil(V/32)] with unconstrained rows all ones, on CPU only the
     constrained rows), filled on the host by xgrammar's batch matcher (on threads), copied to the
     device once (pinned, non-blocking) and applied there by one kernel (kernels/bitmask.py). In an
     overlapped step (overlap.py) the previous step's tokens are read and advance the matchers, and the
     mask is filled, while the step's forward runs; its sampling is enqueued after the copy.
  3. Each appended token advances the matcher (`stop.take_token`); once the grammar has
     accepted a stop token (it allows only those when it is complete) the request ends with "stop", and
     `max_tokens` still ends it with "length" first, never a hang.
  A request whose answer starts inside a thinking block (`SamplingParams.thinking`) has a matcher even
  without a grammar: its gate (thinking.py) keeps the grammar off until the block ends and forces the
  block's end once its budget is spent (`_force`).
  Disaggregated: the prefill engine samples the first token under the grammar; the decode engine
  compiles the same spec (it travels in the sampling params), and `adopt` replays the first token into
  a fresh matcher before the request joins the batch: its state is the prefill's, token for token.

`check_grammar(spec)` (sampling/grammar_check.py) parses a spec without a tokenizer (cheap, cached): the
router and the worker front end call it to answer a bad schema, regex or grammar with a 400 before
anything reaches an engine.
"""

from __future__ import annotations

import functools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from splitserve.engine.thinking import ThinkingGate
from splitserve.sampling.grammar_check import GrammarError, build_grammar
from splitserve.sampling.params import GrammarSpec, SamplingParams

if TYPE_CHECKING:
    import xgrammar


log = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept per engine


class GrammarTimeout(RuntimeError):
    """A request's grammar did not compile within the engine's deadline."""


class Grammars:
    """One engine's grammar compiler: compiled grammars cached per spec, compiled on `threads` threads."""

    def __init__(
        self,
        hf_tokenizer: Any,
        vocab_size: int,
        stop_token_ids: Sequence[int],
        load: Callable[[], Any] | None = None,
        threads: int = 2,
    ) -> None:
        """`hf_tokenizer`: transformers' tokenizer of the vocabulary, or None with `load`, which gives it
        on the first compile (loading transformers costs seconds an engine that never constrains
        output need not pay). `threads`: grammars compiled at once."""
        self._hf, self._load = hf_tokenizer, load
        self.vocab_size = vocab_size
        self._stop = list(stop_token_ids)
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.ready_at: float | None = None  # time.monotonic() once the compiler (and tokenizer) is built
        self._json_safe: torch.Tensor | None = None  # [W] int32: tokens without bytes below 0x20
        self._lock = threading.Lock()
        self._compiler_lock = threading.Lock()
        self._cache: OrderedDict[tuple, Future] = OrderedDict()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="grammar")

    def _tokenizer(self) -> Any:
        if self._hf is None and self._load is not None:
            self._hf = self._load()
        return self._hf

    def compile(self, spec: GrammarSpec) -> Future:
        """-> a Future of the compiled grammar (done at once if cached). Its exception: GrammarError."""
        if self._hf is None and self._load is None:
            raise ValueError("this engine has no tokenizer: it cannot constrain output to a grammar")
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is not None:
                self._cache.move_to_end(spec.key)
                return fut
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec.key] = fut
            while len(self._cache) > CACHE_SIZE:
                self._cache.popitem(last=False)
        return fut

    def cancel(self, spec: GrammarSpec) -> bool:
        """Drop the compile of `spec` if it has not started (no request waits for it any more)."""
        with self._lock:
            fut = self._cache.get(spec.key)
            if fut is None or not fut.cancel():
                return False
            del self._cache[spec.key]
        return True

    def matcher(self, spec: GrammarSpec, compiled: xgrammar.CompiledGrammar | None = None) -> Matcher:
        """A fresh matcher. NOTE: without `compiled`, waits for the compile (the decode side's adopt:
        started at build_request, before the KV fetch)."""
        compiled = compiled if compiled is not None else self.compile(spec).result()
        # NOTE: xgrammar lets a bounded string (maxLength) take raw control characters, which JSON
        # forbids: compact JSON (no free whitespace) has no place for them, so they are banned outright
        return Matcher(compiled, self._json_safe if spec.kind in ("json", "json_object") else None)

    def for_request(
        self,
        params: SamplingParams,
        compiled: xgrammar.CompiledGrammar | None = None,
        earlier: Sequence[int] = (),
    ) -> Matcher | None:
        """A request's fresh matcher: its grammar (compiled, or waited for as `matcher` does) behind its
        thinking block's gate, moved past a migrated request's `earlier` output (Request.earlier_output);
        None for a request with neither. Raises GrammarError if the grammar refuses an earlier token."""
        if params.grammar is None and params.thinking is None:
            return None
        matcher = self.matcher(params.grammar, compiled) if params.grammar is not None else Matcher(None)
        matcher.gate = ThinkingGate(params.thinking) if params.thinking is not None else None
        for i, token in enumerate(earlier):
            if not matcher.accept(token):
                raise GrammarError(f"the resumed answer's token {i} ({token}) is not in its grammar")
        return matcher

    def _compile(self, spec: GrammarSpec) -> xgrammar.CompiledGrammar:
        grammar = build_grammar(spec)
        return self._get_compiler().compile_grammar(grammar)

    def _get_compiler(self) -> xgrammar.GrammarCompiler:
        with self._compiler_lock:  # the grammar threads: the first builds it
            if self._compiler is None:
                import xgrammar as xgr

                info = xgr.TokenizerInfo.from_huggingface(
                    self._tokenizer(), vocab_size=self.vocab_size, stop_token_ids=self._stop
                )
                self._json_safe = _without_control_bytes(info.decoded_vocab, self.vocab_size, self._stop)
                self._compiler = xgr.GrammarCompiler(info, max_threads=1)
                self.ready_at = time.monotonic()
            return self._compiler

    def late(self, since: float, timeout_s: float) -> bool:
        """Whether a compile asked for at `since` (time.monotonic()) is past its deadline. The clock starts
        once the compiler is built: the one-time tokenizer load is no request's compile."""
        return self.ready_at is not None and time.monotonic() - max(since, self.ready_at) > timeout_s

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


class Matcher:
    """One request's place in its grammar (`compiled` None: it has none), behind the gate of the thinking
    block its answer starts in, if any (thinking.py): while the block is open the grammar sees no token."""

    def __init__(
        self, compiled: xgrammar.CompiledGrammar | None, allowed: torch.Tensor | None = None
    ) -> None:
        import xgrammar as xgr

        self.matcher = xgr.GrammarMatcher(compiled) if compiled is not None else None
        self.allowed = allowed  # [W] int32, ANDed into every mask
        self.gate: ThinkingGate | None = None

    def accept(self, token: int) -> bool:
        if self.thinking:
            self.gate.accept(token)  # type: ignore[union-attr]  # thinking: a gate is open
            return True
        return self.matcher is None or bool(self.matcher.accept_token(token))

    @property
    def thinking(self) -> bool:
        return self.gate is not None and self.gate.open

    @property
    def needs_tokens(self) -> bool:
        """Whether the next step's sampling depends on this step's token (a grammar to advance, or an
        open thinking block whose end or budget it may reach); once a grammarless block is over, none."""
        return self.matcher is not None or self.thinking

    @property
    def masks(self) -> bool:
        """Whether the grammar masks the next token."""
        return self.matcher is not None and not self.thinking

    @property
    def terminated(self) -> bool:
        return self.masks and bool(self.matcher.is_terminated())  # type: ignore[union-attr]


def _without_control_bytes(vocab: Sequence[bytes], vocab_size: int, keep: Sequence[int]) -> torch.Tensor:
    """A bitmask row [W] int32 of the tokens whose bytes are all >= 0x20 (and the stop tokens)."""
    flags = [bool(piece) and min(piece) >= 0x20 for piece in vocab[:vocab_size]]  # a list: one tensor write
    ok = torch.zeros(-(-vocab_size // 32) * 32, dtype=torch.bool)
    ok[: len(flags)] = torch.tensor(flags, dtype=torch.bool)
    ok[list(keep)] = True
    weights = 1 << torch.arange(32, dtype=torch.int64)
    words = (ok.view(-1, 32).long() * weights).sum(dim=1)  # [W] as unsigned 32-bit values
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


class Constrained(Protocol):
    """What mask_logits reads of a request (engine/request.py's Request)."""

    grammar: Matcher | None


def mask_logits(
    logits: torch.Tensor, reqs: Sequence[Constrained], host: dict[str, torch.Tensor] | None = None
) -> torch.Tensor:
    """`logits` [N, V] with the tokens each constrained row's grammar forbids set to -inf.
    NOTE: in place (the sampler's logits are its own: the runner's output, or a copy of it).
    `host`: where the caller keeps its pinned bitmask buffer (one per engine: an overlapped step's copy
    out of it may still be queued when the call returns)."""
    n, vocab = logits.shape
    gates = [(i, r.grammar.gate) for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.gate]
    forced = [(i, t) for i, gate in gates if gate is not None and (t := gate.forced_token()) is not None]
    if forced:
        _force(logits, forced)
    live = [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.masks]
    live = [(i, m) for i, m in live if not m.terminated]
    if not live:
        return logits
    words = -(-vocab // 32)
    if logits.device.type == "cuda":
        return _mask_on_device(logits, live, words, _pinned if host is None else host)
    bitmask = torch.empty((len(live), words), dtype=torch.int32)  # [L, W], one row per live row
    _batch_matcher().batch_fill_next_token_bitmask([m.matcher for _, m in live], bitmask)  # whole rows
    _and_allowed(bitmask, [(k, m) for k, (_, m) in enumerate(live)])
    unpacked = np.unpackbits(np.invert(bitmask.numpy()).view(np.uint8), axis=1, bitorder="little")
    forbidden = torch.from_numpy(unpacked.view(np.bool_))[:, :vocab]  # [L, V]
    with torch.inference_mode():  # the runner's logits are inference tensors: updated in place here
        if len(live) == n:
            return logits.masked_fill_(forbidden, float("-inf"))
        rows = torch.tensor([i for i, _ in live])
        logits[rows] = logits[rows].masked_fill_(forbidden, float("-inf"))
    return logits


def _force(logits: torch.Tensor, forced: list[tuple[int, int]]) -> None:
    """Rows whose thinking budget is spent: -inf everywhere but the token forced. `forced`: (row, token)."""
    rows = torch.tensor([i for i, _ in forced], device=logits.device)
    tokens = torch.tensor([t for _, t in forced], device=logits.device)
    with torch.inference_mode():
        logits[rows] = float("-inf")
        logits[rows, tokens] = 0.0


def _mask_on_device(
    logits: torch.Tensor, live: list[tuple[int, Matcher]], words: int, host: dict[str, torch.Tensor]
) -> torch.Tensor:
    """CUDA: one [N, W] bitmask (unconstrained rows all ones) filled on the host by xgrammar's batch
    matcher (on its threads), one pinned non-blocking copy, one kernel. Nothing waits for the GPU: in an
    overlapped step this runs while the step's forward does."""
    n = logits.shape[0]
    bitmask = _host_bitmask(host, n, words)
    rows = None
    if len(live) < n:
        bitmask.fill_(-1)
        rows = [i for i, _ in live]
    _batch_matcher().batch_fill_next_token_bitmask([m.matcher for _, m in live], bitmask, rows)
    _and_allowed(bitmask, live)
    on_device = bitmask.to(logits.device, non_blocking=True)
    with torch.inference_mode():
        try:
            from splitserve.kernels.bitmask import apply_bitmask_
        except ImportError:  # no triton: unpacked by torch
            bits = torch.arange(32, dtype=torch.int32, device=logits.device)
            banned = ((on_device[:, :, None] >> bits) & 1 == 0).reshape(n, -1)[:, : logits.shape[1]]
            return logits.masked_fill_(banned, float("-inf"))
        return apply_bitmask_(logits, on_device)


def _and_allowed(bitmask: torch.Tensor, rows: Sequence[tuple[int, Matcher]]) -> None:
    """AND each row's extra allow-list (`Matcher.allowed`) into its row of `bitmask`, one op per list."""
    groups: dict[int, tuple[torch.Tensor, list[int]]] = {}
    for row, m in rows:
        if m.allowed is not None:
            groups.setdefault(id(m.allowed), (m.allowed, []))[1].append(row)
    for allowed, idx in groups.values():
        if len(idx) == bitmask.shape[0]:
            bitmask &= allowed
        else:
            bitmask[idx] &= allowed


_pinned: dict[str, torch.Tensor] = {}  # CUDA: the pinned host buffer of callers that keep none


def _host_bitmask(host: dict[str, torch.Tensor], rows: int, words: int) -> torch.Tensor:
    """[rows, words] int32 on the host, uninitialized (xgrammar fills whole rows); pinned, kept in
    `host` and reused. NOTE: reuse is safe: the previous step's copy out of it finished when its tokens
    were read (an overlapped step fills the next mask only after reading the pending step's tokens)."""
    buf = host.get("bitmask")
    if buf is None or buf.shape[0] < rows or buf.shape[1] != words:
        buf = host["bitmask"] = torch.empty((max(rows, 64), words), dtype=torch.int32, pin_memory=True)
    return buf[:rows]


@functools.lru_cache(maxsize=1)
def _batch_matcher() -> Any:
    import xgrammar as xgr

    return xgr.BatchGrammarMatcher()


__all__ = ["GrammarTimeout", "Grammars", "Matcher", "mask_logits"]
