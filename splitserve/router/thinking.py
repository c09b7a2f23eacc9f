"""What a chat request asks of the model's thinking, for a model that thinks in a `<think>` block (its
template's reasoning shape, parsers/reasoning.py).

  - `reasoning_effort` (OpenAI's field; `reasoning.effort` on /v1/responses) maps onto the template's
    switch, `enable_thinking`: "none" and "minimal" turn thinking off, "low", "medium" and "high" leave
    it on (this server has no finer knob: to bound the thinking, send `thinking_token_budget`). A value
    the switch cannot honour is a 400: on a template without `enable_thinking`, or on a model that does
    not think, any value but "none" / "minimal" (which ask for what such a model already does); one that
    contradicts `chat_template_kwargs.enable_thinking` too.
  - When the rendered prompt opens the thinking block (Qwen3.5's ends with `<think>\\n`), the sampling
    params carry `thinking` (sampling/params.py) whenever the answer is constrained (the grammar then
    holds only what follows `</think>`) or a `thinking_token_budget` (vLLM's name) bounds it: after that
    many tokens the engine writes `\\n</think>\\n\\n` and the answer begins.
  - When the model opens the block itself (Qwen3's template leaves `<think>` to it), a budget still
    holds: `thinking.start` makes the engine wait for the answer's `<think>`. With a constrained answer
    that is a 400: the grammar holds from the first token, so the model could not open the block.
  - `ThinkingTokens` counts each choice's thinking tokens off its token ids, for usage's
    `completion_tokens_details.reasoning_tokens`: the block's tokens, its `<think>` and `</think>` included.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from splitserve.router.openai_protocol import APIError
from splitserve.router.parsers.reasoning import END_THINK, THINK, starts_in_reasoning
from splitserve.sampling.params import ThinkingSpec

EFFORT_OFF = ("none", "minimal")
EFFORT_ON = ("low", "medium", "high")
FORCED_END = f"\n{END_THINK}\n\n"


def apply_effort(
    effort: str | None, kwargs: dict[str, Any], reasoning: str | None, template: str | None
) -> None:
    """`reasoning_effort` into the template's kwargs (`enable_thinking`), or a 400 saying why it cannot be."""
    if effort is None:
        return
    if effort not in EFFORT_OFF + EFFORT_ON:
        _refuse(f"reasoning_effort must be one of {', '.join(EFFORT_OFF + EFFORT_ON)}, not {effort!r}")
    on = effort in EFFORT_ON
    if reasoning is None:
        if on:
            _refuse(f"reasoning_effort {effort!r}: this model does not think (its chat template has no "
                    'thinking block); only "none" or "minimal" apply')  # fmt: skip
        return
    if "enable_thinking" not in (template or ""):
        _refuse(f"reasoning_effort {effort!r}: this model's chat template has no enable_thinking switch, "
                "so its thinking cannot be turned on or off")  # fmt: skip
    given = kwargs.get("enable_thinking")
    if given is not None and bool(given) != on:
        _refuse(f"reasoning_effort {effort!r} contradicts chat_template_kwargs.enable_thinking {given!r}")
    kwargs["enable_thinking"] = on


def _refuse(message: str) -> None:
    raise APIError(400, message, param="reasoning_effort")


def thinking_params(
    tokenizer: Any, reasoning: str | None, prompt_tail: str, constrained: bool, budget: int | None
) -> ThinkingSpec | None:
    """The sampling params' `thinking` (or None) for a prompt ending in `prompt_tail`."""
    if reasoning is None or not starts_in_reasoning(reasoning, prompt_tail):
        if budget is not None and reasoning is None:
            raise APIError(400, "thinking_token_budget: this model does not think (its chat template has no "
                           "thinking block)", param="thinking_token_budget")  # fmt: skip
        if budget is None or prompt_tail.rstrip().endswith(END_THINK):  # no budget, or thinking off
            return None
        if constrained:  # the grammar holds from the answer's first token: no room to open a block
            raise APIError(400, "thinking_token_budget with a constrained answer (response_format, a "
                           "forced tool call) needs a chat template whose prompt opens the thinking block; "
                           "this model opens it itself", param="thinking_token_budget")  # fmt: skip
        start = tokenizer.encode(THINK, add_special_tokens=False)  # the model writes <think> first
        return ThinkingSpec(tuple(_ids(tokenizer, END_THINK)), tuple(_ids(tokenizer, FORCED_END)), budget,
                            tuple(start))  # fmt: skip
    if not constrained and budget is None:
        return None
    return ThinkingSpec(tuple(_ids(tokenizer, END_THINK)), tuple(_ids(tokenizer, FORCED_END)), budget)


def _ids(tokenizer: Any, text: str) -> list[int]:
    return tokenizer.encode(text, add_special_tokens=False)


class ThinkingTokens:
    """One choice's thinking tokens, counted from its token ids: from the answer's start when the prompt
    opened the block (`inside`), else from a `start` the answer opens with, to the first of `ends` (the
    model's `</think>`, or the text a budget forces), both included."""

    def __init__(self, start: tuple[int, ...], ends: tuple[tuple[int, ...], ...], inside: bool) -> None:
        self.start, self.ends = start, ends
        self.count = 0
        self._state = "inside" if inside else "start"  # start | inside | done
        self._recent: tuple[int, ...] = ()
        self._keep = max(len(start), *(len(e) for e in ends))

    def feed(self, token_ids: list[int]) -> None:
        for token in token_ids:
            if self._state == "done":
                return
            self.count += 1
            self._recent = (self._recent + (token,))[-self._keep :]
            if self._state == "start":
                if self._recent != self.start[: self.count]:
                    self._state, self.count = "done", 0  # the answer opens no block
                elif self.count == len(self.start):
                    self._state = "inside"
            elif any(self._recent[-len(end) :] == end for end in self.ends):
                self._state = "done"


def thinking_counter(
    tokenizer: Any, reasoning: str | None, prompt_tail: str
) -> Callable[[], ThinkingTokens] | None:
    """A maker of per-choice `ThinkingTokens` (None: the model does not think)."""
    if reasoning is None:
        return None
    start = tuple(tokenizer.encode(THINK, add_special_tokens=False))
    ends = tuple(tuple(tokenizer.encode(e, add_special_tokens=False)) for e in (END_THINK, FORCED_END))
    inside = starts_in_reasoning(reasoning, prompt_tail)
    return lambda: ThinkingTokens(start, ends, inside)


__all__ = ["EFFORT_OFF", "EFFORT_ON", "ThinkingTokens", "apply_effort", "thinking_counter", "thinking_params"]
