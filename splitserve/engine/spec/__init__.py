"""Speculative decoding: draft tokens proposed cheaply, verified by the target model in one step.

- config/speculative.py (outside this package: the manifest reads it): `SpeculativeConfig`.
- ngram.py: the prompt-lookup drafter (the tokens that followed the latest earlier occurrence of the
  context's last n tokens).
- mtp.py: the MTP drafter (Qwen3.5's multi-token-prediction head, model/qwen3_5_mtp.py: caught up on
  every step's positions, then chained for k drafts); mtp_graphs.py: its runs as CUDA graphs.
- accept.py: the acceptance rules (greedy: the drafts matching the target's argmax; sampled: rejection
  sampling, so the output follows the target distribution exactly).
- verify.py: the engine's side: which requests draft (and the back-off), the verify step's
  bookkeeping (tokens taken, computed tokens rolled back, blocks past the new end returned, hybrid
  models' recurrent state restored) and the acceptance counters.
- rows.py: a verify chunk of a model without recurrent state laid out as decode rows.
"""
