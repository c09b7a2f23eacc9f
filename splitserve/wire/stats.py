"""Shared by a worker's GET /stats (core/ops.py) and the router that reads it (router/vllm_metrics.py):
the bucket bounds of the tokens-per-engine-step histogram, vLLM's `vllm:iteration_tokens_total`. The
body's `iteration_tokens` is {"counts": one count per bound and one above the largest, "sum": tokens}."""

from __future__ import annotations

STEP_TOKEN_BUCKETS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)

__all__ = ["STEP_TOKEN_BUCKETS"]
