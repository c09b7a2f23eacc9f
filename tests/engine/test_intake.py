"""Prompt token ids as `LLMEngine.add_request` takes them: converted to ints and checked."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from splitserve.engine.intake import RequestFactory


@pytest.fixture
def factory() -> RequestFactory:
    return RequestFactory(None, 100, (), 64, 8, 16, torch.device("cpu"))


@pytest.mark.parametrize(
    "prompt",
    [
        [3, 99, 0],
        (3, 99, 0),
        np.array([3, 99, 0]),
        torch.tensor([3, 99, 0]),
        [3.0, 99.5, False],
        ["3", "99", "0"],
    ],
)
def test_ids_of_any_integer_like_sequence_become_plain_ints(factory: RequestFactory, prompt: object) -> None:
    ids = factory.prompt_ids(prompt)  # type: ignore[arg-type]
    assert ids == [3, 99, 0] and all(type(t) is int for t in ids)


@pytest.mark.parametrize("prompt", [[1, -1], [100], [2**70], [-(2**70), 1]])
def test_ids_outside_the_vocabulary_are_refused(factory: RequestFactory, prompt: list[int]) -> None:
    with pytest.raises(ValueError, match=r"prompt token ids must be in \[0, 100\)"):
        factory.prompt_ids(prompt)


def test_an_empty_prompt_is_refused(factory: RequestFactory) -> None:
    with pytest.raises(ValueError, match="the prompt is empty"):
        factory.prompt_ids([])
