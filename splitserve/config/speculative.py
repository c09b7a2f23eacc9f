"""`SpeculativeConfig`: what vLLM's `--speculative-config` JSON holds, for the methods this engine has.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 5}
    {"method": "mtp", "num_speculative_tokens": 2}

`ngram`: prompt lookup, for every model. `mtp`: the checkpoint's own multi-token-prediction head
(Qwen3.5's `mtp.*` layers; model/qwen3_5_mtp.py); the prompt_lookup fields do not apply to it.

`disable_by_batch_size` (vLLM's name): no request drafts while this many or more requests run, since a
large batch is compute-bound and a verify step's extra rows cost more than the steps they save.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

METHODS = ("ngram", "mtp")
DEFAULT_DISABLE_BY_BATCH_SIZE = 8


@dataclass(frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # k: drafts verified per request and step, at most
    prompt_lookup_min: int | None = None  # shortest n-gram matched (None: prompt_lookup_max's, or 2)
    prompt_lookup_max: int | None = None  # longest n-gram matched (None: prompt_lookup_min's, or 5)
    disable_by_batch_size: int | None = DEFAULT_DISABLE_BY_BATCH_SIZE  # None: draft at any batch size

    def __post_init__(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo, hi = 2, 5
        lo = hi if lo is None else lo
        hi = lo if hi is None else hi
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.method not in METHODS:
            raise ValueError(f"speculative method must be one of {METHODS}, got {self.method!r}")
        for name in ("num_speculative_tokens", "prompt_lookup_min", "prompt_lookup_max"):
            value = getattr(self, name)
            if not _positive_int(value):
                raise ValueError(f"speculative {name} must be a positive integer, got {value!r}")
        if self.num_speculative_tokens > 16:
            raise ValueError("speculative num_speculative_tokens must be at most 16")
        if lo > hi:  # type: ignore[operator]
            raise ValueError("speculative prompt_lookup_min must not exceed prompt_lookup_max")
        cap = self.disable_by_batch_size
        if cap is not None and not _positive_int(cap):
            raise ValueError(f"speculative disable_by_batch_size must be a positive integer, got {cap!r}")

    @property
    def ngram_range(self) -> tuple[int, int]:
        return int(self.prompt_lookup_min or 1), int(self.prompt_lookup_max or 1)


def _positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def speculative_config(value: SpeculativeConfig | dict[str, Any] | str | None) -> SpeculativeConfig | None:
    """A `SpeculativeConfig` from itself, a dict of its fields or their JSON (None: speculation off).
    Unknown fields are refused by name (a typo must not turn speculation silently off)."""
    if value is None or isinstance(value, SpeculativeConfig):
        return value
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as exc:
            raise ValueError(f"speculative config is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError("speculative config must be a JSON object")
    known = {f.name for f in fields(SpeculativeConfig)}
    unknown = sorted(set(value) - known)
    if unknown:
        raise ValueError(f"unknown speculative config fields {unknown}; known: {sorted(known)}")
    return SpeculativeConfig(**value)


def checked_dict(value: dict[str, Any] | None) -> dict[str, Any] | None:
    """`value` as given where it makes a valid `SpeculativeConfig` (or is None); else the ValueError
    that names the bad field (the manifest keeps the dict, the engine parses it again)."""
    if value is not None:
        speculative_config(value)
    return value
