"""Prompt lookup (n-gram) drafting: the tokens that followed an earlier occurrence of the context's
last n tokens, searched in the prompt and the output so far.

For n from `max_n` down to `min_n`, the most recent earlier window equal to the last n tokens wins
(the longest match first, as vLLM's proposer does); the drafts are the up to `k` tokens after it.
"""

from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


class NgramDrafter:
    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n = min_n
        self.max_n = max_n

    def propose(self, tokens: np.ndarray, k: int) -> list[int]:
        """Up to `k` draft tokens to follow `tokens` ([L] int64: prompt and output); [] if no match."""
        length = len(tokens)
        if k <= 0:
            return []
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            # every window that starts before the suffix itself and has a token after it
            windows = sliding_window_view(tokens[: length - 1], n)  # [L - n, n]
            hits = np.flatnonzero((windows == tokens[length - n :]).all(axis=1))
            if hits.size:
                start = int(hits[-1]) + n
                return tokens[start : start + k].tolist()
        return []
