"""What a chat request asks of the model's thinking (router/thinking.py), without a server: reasoning_effort
onto the template's switch or a 400, the sampling params' `thinking` for a prompt that opens the block,
and the thinking tokens counted for usage."""

from __future__ import annotations

from pathlib import Path

import pytest

from splitserve.model.tokenizer import load_tokenizer
from splitserve.router.openai_protocol import APIError
from splitserve.router.thinking import ThinkingTokens, apply_effort, thinking_counter, thinking_params
from splitserve.sampling.params import ThinkingSpec

TEMPLATE = (Path(__file__).parents[1] / "fixtures" / "qwen3_5" / "chat_template.jinja").read_text()


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(None)


@pytest.mark.parametrize(
    ("effort", "on"), [("none", False), ("minimal", False), ("low", True), ("high", True)]
)
def test_reasoning_effort_sets_enable_thinking(effort, on):
    kwargs: dict = {}
    apply_effort(effort, kwargs, "qwen3", TEMPLATE)
    assert kwargs == {"enable_thinking": on}


@pytest.mark.parametrize(
    ("effort", "reasoning", "template", "kwargs", "words"),
    [("extreme", "qwen3", TEMPLATE, {}, "must be one of"),
     ("high", None, None, {}, "does not think"),
     ("low", "qwen3", "<think>{{ x }}</think>", {}, "no enable_thinking switch"),
     ("high", "qwen3", TEMPLATE, {"enable_thinking": False}, "contradicts")],
)  # fmt: skip
def test_reasoning_effort_that_cannot_be_honoured_is_a_400(effort, reasoning, template, kwargs, words):
    with pytest.raises(APIError, match=words) as err:
        apply_effort(effort, dict(kwargs), reasoning, template)
    assert err.value.status == 400 and err.value.param == "reasoning_effort"


def test_reasoning_effort_none_on_a_model_that_does_not_think_changes_nothing():
    kwargs: dict = {}
    apply_effort("none", kwargs, None, None)
    assert kwargs == {}


def test_thinking_params_for_a_prompt_that_opens_the_block(tok):
    opened, closed = "<|im_start|>assistant\n<think>\n", "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    end = tok.encode("</think>", add_special_tokens=False)
    assert thinking_params(tok, "qwen3", opened, True, None) == ThinkingSpec(
        tuple(end), tuple(tok.encode("\n</think>\n\n", add_special_tokens=False)), None
    )
    spec = thinking_params(tok, "qwen3", opened, False, 5)
    assert spec is not None and spec.budget == 5
    assert thinking_params(tok, "qwen3", opened, False, None) is None  # nothing for the engine to do
    assert thinking_params(tok, "qwen3", closed, True, 5) is None  # thinking off: no block to bound
    with pytest.raises(APIError, match="does not think"):
        thinking_params(tok, None, "", False, 5)
    own = thinking_params(tok, "qwen3", "<|im_start|>assistant\n", False, 5)  # the model writes <think>
    assert (
        own is not None
        and own.budget == 5
        and own.start == tuple(tok.encode("<think>", add_special_tokens=False))
    )
    with pytest.raises(APIError, match="opens it itself") as err:
        thinking_params(tok, "qwen3", "<|im_start|>assistant\n", True, 5)
    assert err.value.status == 400 and err.value.param == "thinking_token_budget"


def test_thinking_tokens_counted_to_the_end_of_the_block():
    start, end, forced = (1, 2), (7, 8), (6, 7, 8, 9)
    counter = ThinkingTokens(start, (end, forced), inside=True)
    counter.feed([3, 4])
    counter.feed([7, 8, 5, 5])
    assert counter.count == 4
    opened = ThinkingTokens(start, (end,), inside=False)
    opened.feed([1, 2, 3, 7, 8, 9])
    assert opened.count == 5
    plain = ThinkingTokens(start, (end,), inside=False)
    plain.feed([1, 3, 7, 8])
    assert plain.count == 0


def test_thinking_counter_reads_the_prompt(tok):
    assert thinking_counter(tok, None, "") is None
    counter = thinking_counter(tok, "qwen3", "assistant\n<think>\n")()
    counter.feed(tok.encode("hmm, let me see\n</think>\n\nParis", add_special_tokens=False))
    assert counter.count == len(tok.encode("hmm, let me see\n</think>", add_special_tokens=False))
