"""Top-1 agreement of generated tokens with a reference model's logits, teacher-forced: how the GPU
tests and `bench/bf16_agreement.py` compare our bf16 output with HF transformers'.

In bf16 two tokens often share the top logit, and argmax then takes the lower id; so each count is
given strictly (the reference's argmax is the token) and with ties (the token's logit equals the
reference's top logit).
"""

from __future__ import annotations

import torch


def top1_counts(logits: torch.Tensor, tokens: torch.Tensor) -> tuple[int, int]:
    """logits [T, V] (a reference's, at the positions that predicted `tokens` [T]) -> (steps whose
    argmax is the token, steps whose token's logit equals the top logit)."""
    strict = int((logits.argmax(-1) == tokens).sum())
    tied = int((logits.gather(1, tokens[:, None])[:, 0] == logits.max(-1).values).sum())
    return strict, tied


@torch.inference_mode()
def hf_self_agreement(
    hf: torch.nn.Module, prompts: list[list[int]], new_tokens: int, device: str | torch.device
) -> tuple[int, int, int]:
    """An HF model against itself: its own greedy `generate` (one token a step, its KV cache), teacher-
    forced through its own forward over the whole sequence (the check our engine is put through).
    The two differ only in the shapes of the same products, so this is the agreement the reference
    itself reaches. -> (strict, tied, steps), as `top1_counts`."""
    strict = tied = total = 0
    for prompt in prompts:
        ids = torch.tensor([prompt], device=device)
        full = hf.generate(
            ids, max_new_tokens=new_tokens, min_new_tokens=new_tokens, do_sample=False, pad_token_id=0
        )
        gen = full[0, len(prompt) :]
        s, t = top1_counts(hf(full).logits[0, len(prompt) - 1 : -1], gen)
        strict, tied, total = strict + s, tied + t, total + len(gen)
    return strict, tied, total
