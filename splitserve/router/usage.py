"""A request's token count as OpenAI's `usage` object reports it: prompt tokens once per prompt, the
completion tokens of every choice, the prompt tokens a prefix cache served
(`prompt_tokens_details.cached_tokens`) and, for a model that thinks, its reasoning tokens. run.py tallies
each choice as its pieces arrive."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from splitserve.sampling.logprobs import TokenLogprob

if TYPE_CHECKING:
    from splitserve.router.thinking import ThinkingTokens


@dataclass
class ChoiceTally:
    """One choice's output so far and what it cost."""

    index: int
    prompt_len: int
    prompt: int  # which of the request's prompts it answers
    tokens: int = 0
    text: str = ""
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish_reason: str | None = None
    last_time: float = 0.0
    thinking: ThinkingTokens | None = None  # its thinking tokens counted (a model that thinks)
    # its prompt tokens that a worker's prefix cache served (disaggregated: the prefill worker's), as the
    # worker reports it with the first token
    cached: int = 0


def cached_tokens(choices: Sequence[ChoiceTally]) -> int:
    """The prompt tokens a prefix cache served, each prompt counted once as `prompt_tokens` counts it.
    With n > 1 a prompt's choices run apart; its figure is the least any of them found (a sibling may
    hit the blocks another choice of the same request has just computed)."""
    least: dict[int, int] = {}
    for c in choices:
        least[c.prompt] = min(least.get(c.prompt, c.cached), c.cached)
    return sum(least.values())


def usage(choices: Sequence[ChoiceTally], prompt_tokens: int) -> dict[str, Any]:
    """The `usage` object of a chat or text completion (whole, or a stream's last chunk)."""
    done = sum(c.tokens for c in choices)
    out: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": done,
        "total_tokens": prompt_tokens + done,
        "prompt_tokens_details": {"cached_tokens": cached_tokens(choices)},
    }
    if any(c.thinking is not None for c in choices):
        thought = sum(c.thinking.count for c in choices if c.thinking is not None)
        out["completion_tokens_details"] = {"reasoning_tokens": thought}
    return out
