"""The manifest's limits on what a request may cost: `server.structured`, what a grammar may cost
(sampling/grammar_limits.py checks a request's spec against it at the router; the engines compile within
its deadline and thread count), and `server.rate_limit`, a token bucket per client (router/gate.py).

    server:
      structured: {max_enum_values, max_choices, max_schema_depth, max_schema_bytes, max_pattern_chars,
                   max_repetition, allow_nested_quantifiers, compile_timeout_s, compile_threads}
      rate_limit: {requests_per_s, burst}      # null (the default): no rate limit
"""

from __future__ import annotations

import math

from pydantic import BaseModel, ConfigDict, Field, model_validator

from splitserve.sampling.grammar_limits import GrammarLimits

_LIMITS = GrammarLimits()


class StructuredSection(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    max_enum_values: int = Field(default=_LIMITS.max_enum_values, ge=1, le=1 << 20)
    max_choices: int = Field(default=_LIMITS.max_choices, ge=1, le=1 << 20)
    max_schema_depth: int = Field(default=_LIMITS.max_schema_depth, ge=2, le=1 << 10)
    max_schema_bytes: int = Field(default=_LIMITS.max_schema_bytes, ge=1024, le=1 << 30)
    max_pattern_chars: int = Field(default=_LIMITS.max_pattern_chars, ge=16, le=1 << 20)
    max_repetition: int = Field(default=_LIMITS.max_repetition, ge=1, le=1 << 30)
    allow_nested_quantifiers: bool = _LIMITS.allow_nested_quantifiers
    # a request whose grammar has not compiled by then ends with a 503 (its compile goes on, cached)
    compile_timeout_s: float = Field(default=30.0, gt=0, le=3600, allow_inf_nan=False)
    compile_threads: int = Field(default=2, ge=1, le=64)  # per engine; xgrammar releases the GIL

    def limits(self) -> GrammarLimits:
        names = GrammarLimits.__dataclass_fields__
        return GrammarLimits(**{k: v for k, v in self.model_dump().items() if k in names})


class RateLimitSection(BaseModel):
    """Per client (its API key, else its address): `burst` requests at once, `requests_per_s` after."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    requests_per_s: float = Field(gt=0, le=1e6, allow_inf_nan=False)
    burst: int | None = Field(default=None, ge=1, le=1 << 20)  # null: requests_per_s, at least 1

    @model_validator(mode="after")
    def _burst(self) -> RateLimitSection:
        if self.burst is None:
            object.__setattr__(self, "burst", max(1, math.ceil(self.requests_per_s)))
        return self


__all__ = ["RateLimitSection", "StructuredSection"]
