"""What one engine step costs, and what one handoff costs: the model the simulator runs on.

A step's work is summarized by its `StepShape`:

    prefill_tokens   prompt tokens computed in the step (every chunk of every prefilling request)
    prefill_pairs    attention work of those chunks: for a chunk of n tokens starting at position s,
                     n * (s + (n + 1) / 2) query-key pairs (a causal chunk over what came before it)
    decode_seqs      requests that compute one token in the step (decoding)
    decode_context   sum of those requests' context lengths (the KV each one reads)

and its time is a linear function of those four (plus a fixed cost per step), stretched by what
serving adds to the engine's time (measured through the server: served.py; `served_factor` for a step
with prompt tokens, `served_decode_factor` for a decode-only step, whose every token the front end
streams, a larger share of a 30 ms step than of a 800 ms prompt step):

    step_s = served * (base_s + prefill_token_s * prefill_tokens + prefill_pair_s * prefill_pairs
                       + decode_seq_s * decode_seqs + decode_context_s * decode_context)

A token reaches the client `request_s` after the step that sampled it (the fixed cost of the request's
way through the load client, the router and the worker's front end; TTFT carries it, token gaps do not).
A handoff of a prompt of L tokens moves `kv_bytes_per_token * L + state_bytes` bytes and takes
`latency_s + bytes / bytes_per_s`. `profile.py` fits the coefficients to steps measured on the real
engine and the real transport; tests set them by hand.
"""

from __future__ import annotations

from dataclasses import dataclass

import msgspec


@dataclass(frozen=True)
class StepShape:
    prefill_tokens: int = 0
    prefill_pairs: float = 0.0
    decode_seqs: int = 0
    decode_context: int = 0

    @property
    def empty(self) -> bool:
        return self.prefill_tokens == 0 and self.decode_seqs == 0


def chunk_pairs(start: int, n: int) -> float:
    """Query-key pairs of a causal chunk of `n` tokens at positions start .. start + n - 1."""
    return n * (start + (n + 1) / 2)


class StepCost(msgspec.Struct, frozen=True, kw_only=True):
    """The fitted step-time and handoff model (seconds, bytes). Zero coefficients mean no such cost."""

    base_s: float = 0.0
    prefill_token_s: float = 0.0
    prefill_pair_s: float = 0.0
    decode_seq_s: float = 0.0
    decode_context_s: float = 0.0
    # the handoff (disaggregated deployments only)
    latency_s: float = 0.0
    bytes_per_s: float = float("inf")
    kv_bytes_per_token: int = 0
    state_bytes: int = 0  # recurrent state of hybrid models, per request
    # a step runs this many times slower while another worker of the host is in a step too (workers on
    # cores of their own still share one memory bus and the last-level cache; corun.py measures them):
    corun_factor: float = 1.0  # a decode-only step beside a decode-only step
    corun_prefill_factor: float = 1.0  # a step with prompt tokens beside a decode-only step
    corun_decode_prefill_factor: float = 1.0  # a decode-only step beside a step with prompt tokens
    corun_prefill_prefill_factor: float = 1.0  # a step with prompt tokens beside another such
    # a step through the server (load client, router and front end beside the engine) over the same
    # step in the engine alone (served.py); 1: the engine's own times
    served_factor: float = 1.0  # steps with prompt tokens
    served_decode_factor: float = 1.0  # decode-only steps
    # a request's fixed way outside the engine's steps (the load client, the router, the worker's front
    # end, HTTP and streaming): each token reaches the client this long after its step ends (served.py)
    request_s: float = 0.0

    def step_s(self, shape: StepShape) -> float:
        if shape.empty:
            return 0.0
        served = self.served_factor if shape.prefill_tokens else self.served_decode_factor
        return served * (
            self.base_s
            + self.prefill_token_s * shape.prefill_tokens
            + self.prefill_pair_s * shape.prefill_pairs
            + self.decode_seq_s * shape.decode_seqs
            + self.decode_context_s * shape.decode_context
        )

    def corun(self, prompt: bool, beside_prompt: bool) -> float:
        """The slowdown of a step (`prompt`: it computes prompt tokens) beside another worker's step."""
        if prompt:
            return self.corun_prefill_prefill_factor if beside_prompt else self.corun_prefill_factor
        return self.corun_decode_prefill_factor if beside_prompt else self.corun_factor

    def handoff_bytes(self, prompt_tokens: int) -> int:
        return self.kv_bytes_per_token * prompt_tokens + self.state_bytes

    def transfer_s(self, prompt_tokens: int) -> float:
        return self.latency_s + self.handoff_bytes(prompt_tokens) / self.bytes_per_s

    def prefill_s(self, prompt_tokens: int, start: int = 0) -> float:
        """One step that prefills `prompt_tokens` from position `start`, alone."""
        return self.step_s(StepShape(prompt_tokens, chunk_pairs(start, prompt_tokens)))

    def decode_s(self, batch: int, context: int) -> float:
        """One decode step of `batch` requests, each with `context` tokens."""
        return self.step_s(StepShape(decode_seqs=batch, decode_context=batch * context))


__all__ = ["StepCost", "StepShape", "chunk_pairs"]
