"""Per-request sampling parameters, in vLLM's spelling, validated at construction.

`SamplingParams.grammar` (a `GrammarSpec`) constrains a request's output (structured outputs, forced
tool calls): plain data here; compiling and matching it is engine/grammar.py's. `SamplingParams.thinking`
(a `ThinkingSpec`) says the output starts inside a thinking block: the grammar waits for its end, and
a budget bounds it (engine/thinking.py).

All three are frozen msgspec structs: the one type inside every process and on every wire (the router's
and the worker's JSON, the engine core's msgpack). Decoding runs the same checks as construction
(`__post_init__`), so a body that decodes is a valid request; unknown fields are refused.
"""

from __future__ import annotations

import math

import msgspec
from msgspec.structs import force_setattr, replace

_EPS = 1e-5
_INT32 = 2**31 - 1  # counts and ids: what the sampler's tensors and the scheduler take
_SEED_MAX = 2**63 - 1  # torch.Generator.manual_seed


def _int_in(value: object, lo: int, hi: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and lo <= value <= hi


GRAMMAR_KINDS = ("json", "json_object", "regex", "choice", "ebnf", "structural_tag")


class GrammarSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """What a constrained request's output must match. `spec` by kind: json: a JSON schema (text);
    json_object: unused (any JSON object); regex; choice: a JSON list of the allowed strings; ebnf:
    xgrammar's EBNF (GBNF) text; structural_tag: xgrammar's structural-tag JSON (tool calls).
    `strict`: a JSON schema's objects take no properties beyond those it names."""

    kind: str
    spec: str = ""
    strict: bool = True

    def __post_init__(self) -> None:
        if self.kind not in GRAMMAR_KINDS:
            raise ValueError(f"grammar kind must be one of {GRAMMAR_KINDS}, got {self.kind!r}")
        if not isinstance(self.spec, str) or not isinstance(self.strict, bool):
            raise ValueError("a grammar's spec must be a string and its strict flag a boolean")
        if self.kind != "json_object" and not self.spec:
            raise ValueError(f"a {self.kind} grammar needs a spec")

    @property
    def key(self) -> tuple[str, str, bool]:
        """What its compiled form is cached under."""
        return (self.kind, self.spec, self.strict)


class ThinkingSpec(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """An answer that starts inside the model's thinking block (its prompt opened it): the engine leaves
    the thinking free of the grammar, which constrains only what follows the block's end, and may bound
    it (engine/thinking.py). `end`: the token ids that end the block (`</think>`); `forced`: those written
    in its place once `budget` thinking tokens have been sampled (empty: `end`); `budget`: None for no
    bound (vLLM's `thinking_token_budget`); `start`: for a model that opens the block itself (its prompt
    does not), the ids that open it: the block begins once the answer's first tokens are these, and there
    is none if they are not (empty: the prompt opened it)."""

    end: tuple[int, ...]
    forced: tuple[int, ...] = ()
    budget: int | None = None
    start: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        force_setattr(self, "end", tuple(self.end))
        force_setattr(self, "forced", tuple(self.forced) or tuple(self.end))
        force_setattr(self, "start", tuple(self.start))
        ids = self.end + self.forced + self.start
        if not self.end or not all(_int_in(t, 0, _INT32) for t in ids):
            raise ValueError("thinking.end and thinking.forced must be token ids, end at least one")
        if self.budget is not None and not _int_in(self.budget, 0, _INT32):
            raise ValueError(f"thinking.budget must be a non-negative integer, got {self.budget!r}")


class SamplingParams(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    seed: int | None = None
    max_tokens: int | None = 16  # None: up to max_model_len
    min_tokens: int = 0
    stop: tuple[str, ...] | str = ()  # a lone string is taken as one stop string
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None  # number of top alternatives per token (0: only the sampled token)
    skip_special_tokens: bool = True
    detokenize: bool = True
    grammar: GrammarSpec | None = None  # a dict of its fields is taken too
    thinking: ThinkingSpec | None = None  # likewise
    # a migrated request (router/migrate.py): its prompt's last `resumed` tokens are its own earlier
    # output. A seeded generator is moved past their draws and the presence and frequency penalties
    # count them, so the tokens after the migration are those of a run without it
    resumed: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.stop, str):
            force_setattr(self, "stop", (self.stop,))
        force_setattr(self, "stop", tuple(self.stop))
        force_setattr(self, "stop_token_ids", tuple(self.stop_token_ids))
        if self.top_k < 0:
            force_setattr(self, "top_k", 0)
        if isinstance(self.grammar, dict):
            try:
                force_setattr(self, "grammar", GrammarSpec(**self.grammar))
            except TypeError as exc:
                raise ValueError(f"bad grammar: {exc}") from None
        if self.grammar is not None and not isinstance(self.grammar, GrammarSpec):
            raise ValueError("grammar must be a GrammarSpec or a dict of its fields")
        if isinstance(self.thinking, dict):
            try:
                force_setattr(self, "thinking", ThinkingSpec(**self.thinking))
            except TypeError as exc:
                raise ValueError(f"bad thinking: {exc}") from None
        if self.thinking is not None and not isinstance(self.thinking, ThinkingSpec):
            raise ValueError("thinking must be a ThinkingSpec or a dict of its fields")
        self._validate()

    def _validate(self) -> None:
        """Every value checked here, at admission, so that nothing a request carries can fail a step
        (which runs other requests beside it): ranges, finite floats, integers the tensors can hold."""
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty",
                     "repetition_penalty"):  # fmt: skip
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        for name in ("n", "top_k", "max_tokens", "min_tokens", "logprobs"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or value > _INT32
            ):
                raise ValueError(f"{name} must be an integer of at most {_INT32}, got {value!r}")
        if self.seed is not None and (
            isinstance(self.seed, bool) or not isinstance(self.seed, int) or not 0 <= self.seed <= _SEED_MAX
        ):
            raise ValueError(f"seed must be an integer in [0, {_SEED_MAX}], got {self.seed!r}")
        if not all(
            isinstance(t, int) and not isinstance(t, bool) and 0 <= t <= _INT32 for t in self.stop_token_ids
        ):
            raise ValueError("stop_token_ids must be token ids (integers in [0, 2^31))")
        if not all(isinstance(x, str) for x in self.stop):
            raise ValueError("stop must be a string or a list of strings")
        checks = [
            (self.n >= 1, "n must be at least 1"),
            (self.temperature >= 0, "temperature must be non-negative"),
            (0 < self.top_p <= 1, "top_p must be in (0, 1]"),
            (0 <= self.min_p <= 1, "min_p must be in [0, 1]"),
            (-2 <= self.presence_penalty <= 2, "presence_penalty must be in [-2, 2]"),
            (-2 <= self.frequency_penalty <= 2, "frequency_penalty must be in [-2, 2]"),
            (self.repetition_penalty > 0, "repetition_penalty must be positive"),
            (self.max_tokens is None or self.max_tokens >= 1, "max_tokens must be at least 1"),
            (self.min_tokens >= 0, "min_tokens must be non-negative"),
            (isinstance(self.resumed, int) and self.resumed >= 0, "resumed must be a non-negative integer"),
            (self.logprobs is None or 0 <= self.logprobs <= 20, "logprobs must be in [0, 20]"),
            (all(s for s in self.stop), "stop strings must be non-empty"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)

    @property
    def greedy(self) -> bool:
        return self.temperature < _EPS

    @property
    def has_penalties(self) -> bool:
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0)

    def for_child(self, index: int) -> SamplingParams:
        """Params of the index-th of n samples: n=1, and a distinct seed derived from the parent's."""
        seed = None if self.seed is None else self.seed + index
        return replace(self, n=1, seed=seed)
