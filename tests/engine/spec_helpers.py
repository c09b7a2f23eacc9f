"""Drafters for the speculative-decoding tests, and a step-by-step trace of one request's state."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


class OracleDrafter:
    """Proposes each prompt's known greedy continuation, with every `wrong_every`-th position of the
    output changed (so runs end in a rejection at varying draft positions), or all of them wrong."""

    def __init__(self, prompts: list[list[int]], refs: list[list[int]], vocab: int, wrong_every: int) -> None:
        self.pairs = list(zip(prompts, refs, strict=True))
        self.vocab = vocab
        self.wrong_every = wrong_every  # 1: every draft wrong

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        for prompt, ref in self.pairs:
            if len(tokens) >= len(prompt) and tokens[: len(prompt)].tolist() == prompt:
                done = len(tokens) - len(prompt)
                drafts = list(ref[done : done + k])
                for j in range(len(drafts)):
                    if (done + j) % self.wrong_every == self.wrong_every - 1:
                        drafts[j] = (drafts[j] + 1) % self.vocab
                return drafts
        return []


@dataclass
class Snapshot:
    computed: int
    kv: torch.Tensor  # [L_kv, 2, computed, KVH, D]
    states: dict[str, torch.Tensor]
    blocks: int
    num_tokens: int


def trace(engine, prompt: list[int], params) -> tuple[list[int], list[Snapshot]]:
    """Run one request alone, a step at a time; -> its tokens and its KV / state after each step."""
    rid = engine.add_request(prompt, params)
    req = engine.requests[rid]
    snaps: list[Snapshot] = []
    tokens: list[int] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            tokens = out.outputs[0].token_ids
        if req.finished:
            break
        n = req.num_computed_tokens
        kv = engine.kv_cache[req.block_ids]  # [B, L_kv, 2, bs, KVH, D]
        kv = kv.permute(1, 2, 0, 3, 4, 5).flatten(2, 3)[:, :, :n].clone()
        slot = req.state_slot
        states = {k: t[slot].clone() for k, t in engine.states.states.items()} if slot is not None else {}
        snaps.append(Snapshot(n, kv, states, len(req.block_ids), req.num_tokens))
    return tokens, snaps
