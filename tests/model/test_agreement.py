"""The top-1 agreement counts the GPU tests and bench/bf16_agreement.py report, on CPU."""

from __future__ import annotations

import torch

from splitserve.model.agreement import hf_self_agreement, top1_counts


def test_top1_counts_strict_and_with_ties():
    logits = torch.tensor(
        [
            [0.5, 2.0, 1.0],  # top 1: token 1 agrees
            [3.0, 3.0, 0.0],  # tie of 0 and 1: argmax takes 0; token 1 agrees only with ties
            [1.0, 0.0, 2.0],  # top 2: token 0 disagrees
        ],
        dtype=torch.bfloat16,
    )
    assert top1_counts(logits, torch.tensor([1, 1, 0])) == (1, 2)
    assert top1_counts(logits, torch.tensor([1, 0, 2])) == (3, 3)


def test_hf_self_agreement_counts_every_generated_step():
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from splitserve.model.random_weights import SMALL_QWEN3

    torch.manual_seed(0)
    hf = Qwen3ForCausalLM(Qwen3Config(**SMALL_QWEN3, initializer_range=0.15)).eval()
    prompts = [[5, 17, 3], [900, 2, 41, 7, 7]]
    strict, tied, steps = hf_self_agreement(hf, prompts, 6, "cpu")
    assert steps == 12
    # fp32 on one CPU: generate and the full forward agree (ties aside, which this init keeps rare)
    assert strict <= tied <= steps and tied >= 11
