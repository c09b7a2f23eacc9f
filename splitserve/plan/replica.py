"""One simulated engine: the engine's continuous batching, step by step, with no model behind it.

It follows `engine/scheduler.py`: each step, running requests (oldest first) get the tokens they
still lack (one for a decoding request, up to the rest of the budget for a prefilling one), then
waiting requests are admitted while the token budget and `max_num_seqs` last. A long prompt is so
chunked over ceil(L / budget) steps when alone, and prefill chunks share steps with decode rows. A
step's time comes from the cost model (`cost.StepShape`). Not modelled: KV-cache capacity and
preemption (the planner assumes the pool holds the running batch), sampling and detokenization
apart from what the fitted step time already includes.

Prefix caching: a replica remembers the full blocks of every prompt it has prefilled (without
eviction) and skips the longest cached prefix of a new prompt, keeping at least its last token.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from splitserve.plan.cost import StepCost, StepShape, chunk_pairs


@dataclass(frozen=True)
class EngineLimits:
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    block_size: int = 16
    prefix_caching: bool = True


@dataclass
class Seq:
    """A request inside one replica. `stop_after` tokens sampled ends it there (a prefill worker's
    share of a disaggregated request stops at its first token)."""

    rid: int
    prompt_len: int
    stop_after: int
    blocks: tuple[int, ...] = ()  # chained hashes of the prompt's full blocks (prefix caching)
    computed: int = 0
    cached: int = 0  # prompt tokens the prefix cache served
    sampled: int = 0  # tokens sampled so far (a decode worker's request arrives with its first one)
    token_times: list[float] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        """Tokens whose KV the request will need next: its prompt and every sampled token but the last."""
        return self.prompt_len + max(self.sampled, 0)

    @property
    def done(self) -> bool:
        return self.sampled >= self.stop_after


@dataclass(frozen=True)
class Chunk:
    seq: Seq
    start: int
    n: int

    @property
    def samples(self) -> bool:
        return self.start + self.n == self.seq.num_tokens


class Replica:
    """A worker's engine. `start_step(now)` plans a step and returns its end time; `end_step()`
    applies it and returns the requests that sampled a token and those that finished."""

    def __init__(self, name: str, cost: StepCost, limits: EngineLimits) -> None:
        self.name = name
        self.cost = cost
        self.limits = limits
        self.waiting: deque[Seq] = deque()
        self.running: list[Seq] = []
        self.busy = False
        self.decode_only = False  # the step in flight computes no prompt token
        self.cached: set[int] = set()
        self._chunks: list[Chunk] = []
        self.steps = 0
        self.busy_s = 0.0
        self.prefill_tokens = 0  # prompt tokens this replica computed (prefix hits excluded)
        self.outstanding = 0  # requests routed here and not finished (the router's in-flight count)

    def add(self, seq: Seq) -> None:
        self.waiting.append(seq)
        self.outstanding += 1

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def start_step(self, now: float) -> float:
        """Schedule the next step (the replica must have work); -> when it ends."""
        budget = self.limits.max_num_batched_tokens
        chunks: list[Chunk] = []
        for seq in self.running:
            if budget <= 0:
                break
            n = min(seq.num_tokens - seq.computed, budget)
            chunks.append(Chunk(seq, seq.computed, n))
            budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.limits.max_num_seqs:
            seq = self.waiting.popleft()
            if seq.computed == 0:
                seq.computed = seq.cached = self._cached_prefix(seq)
            n = min(seq.num_tokens - seq.computed, budget)
            self.running.append(seq)
            chunks.append(Chunk(seq, seq.computed, n))
            budget -= n
        self._chunks = chunks
        shape = _shape(chunks)
        self.decode_only = shape.prefill_tokens == 0  # a memory-bound step (cost.StepCost.corun)
        dt = self.cost.step_s(shape)
        self.busy = True
        self.steps += 1
        self.busy_s += dt
        return now + dt

    def end_step(self, now: float) -> tuple[list[Seq], list[Seq]]:
        """-> (requests that sampled a token at `now`, requests that finished here)."""
        sampled, finished = [], []
        for c in self._chunks:
            seq = c.seq
            if seq.computed < seq.prompt_len:
                self.prefill_tokens += min(c.n, seq.prompt_len - seq.computed)
            seq.computed += c.n
            if seq.computed >= seq.prompt_len and self.limits.prefix_caching:
                self.cached.update(seq.blocks)
            if c.samples:
                seq.sampled += 1
                seq.token_times.append(now)
                sampled.append(seq)
                if seq.done:
                    finished.append(seq)
        for seq in finished:
            self.running.remove(seq)
            self.outstanding -= 1
        self._chunks = []
        self.busy = False
        return sampled, finished

    def _cached_prefix(self, seq: Seq) -> int:
        if not self.limits.prefix_caching:
            return 0
        hit = 0
        for h in seq.blocks:
            if h not in self.cached:
                break
            hit += 1
        # at least the prompt's last token is computed, so that the request samples its first token
        size = self.limits.block_size
        return min(hit * size, (seq.prompt_len - 1) // size * size)


def _shape(chunks: list[Chunk]) -> StepShape:
    p_tokens, pairs, d_seqs, d_ctx = 0, 0.0, 0, 0
    for c in chunks:
        if c.start >= c.seq.prompt_len:  # a decode row: one token over its context
            d_seqs += 1
            d_ctx += c.start + 1
        else:
            p_tokens += c.n
            pairs += chunk_pairs(c.start, c.n)
    return StepShape(p_tokens, pairs, d_seqs, d_ctx)


def block_hashes(prompt: tuple[int, ...], block_size: int) -> tuple[int, ...]:
    """Chained hashes of a prompt's full blocks: equal prefixes give equal leading hashes."""
    out, h = [], 0
    for i in range(len(prompt) // block_size):
        h = hash((h, prompt[i * block_size : (i + 1) * block_size]))
        out.append(h)
    return tuple(out)


__all__ = ["Chunk", "EngineLimits", "Replica", "Seq", "block_hashes"]
