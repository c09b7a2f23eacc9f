"""The thinking block of an answer whose prompt opened it (`SamplingParams.thinking`), as the sampler
sees it: free of the request's grammar until it ends, and bounded by a budget.

An answer to Qwen3.5's prompt (which ends with `<think>\\n`) starts inside the model's thinking. The
request's grammar (a JSON schema, a forced tool call) is for the answer after `</think>`, not for the
thinking, so `ThinkingGate` stands in front of the grammar's matcher (grammar.py's `Matcher`):
  - while the block is open, sampled tokens are counted and looked at for `end` (the ids of
    `</think>`); the grammar sees none of them and masks nothing;
  - once `budget` tokens have been sampled in the block, the gate forces `forced` (by default `end`)
    one token a step: every other token's logit is -inf (`forced_token`);
  - when `end` has been sampled (or `forced` written), the block is over and the grammar takes every
    token from the next one on.
For a model that opens the block itself (`start`: Qwen3's template leaves `<think>` to the model), the
gate waits first: the answer's first tokens are compared with `start`; once they all match, the block
is open and counting starts; at the first that does not, there is no block and the gate is done. Such a
request carries no grammar (router/thinking.py refuses the pair): nothing is masked while it waits.
Everything here is a function of the tokens the request has sampled, so a decode engine that replays
the prefill's first token into a fresh gate (engine.py's `adopt`) is in the prefill's state.
"""

from __future__ import annotations

from splitserve.sampling.params import ThinkingSpec


class ThinkingGate:
    """One request's thinking block (see the module docstring)."""

    def __init__(self, spec: ThinkingSpec) -> None:
        self.spec = spec
        self.open = True  # the block has not ended (or, waiting for `start`, may still begin)
        self._started = len(spec.start) == 0  # the block has begun (its `start` is written)
        self._seen = 0  # tokens of `start` matched so far
        self.tokens = 0  # tokens sampled in the block, its end included
        self._recent: list[int] = []  # the last len(end) tokens sampled
        self._forcing = 0  # how many of `forced` are written (0: not forcing)

    def forced_token(self) -> int | None:
        """The token the next step must sample (the budget is spent), or None."""
        if not self.open or not self._started or self.spec.budget is None:
            return None
        if self._forcing == 0 and self.tokens < self.spec.budget:
            return None
        return self.spec.forced[self._forcing]

    def accept(self, token: int) -> None:
        """A token sampled while the block is open (or may still begin)."""
        if not self._started:
            if token != self.spec.start[self._seen]:
                self.open = False  # the answer opens no block
                return
            self._seen += 1
            self._started = self._seen == len(self.spec.start)
            return
        forced = self.forced_token()
        self.tokens += 1
        if forced is not None:
            self._forcing += 1
            self.open = self._forcing < len(self.spec.forced)
            return
        end = self.spec.end
        self._recent = (self._recent + [token])[-len(end) :]
        if tuple(self._recent) == end:
            self.open = False


__all__ = ["ThinkingGate"]
