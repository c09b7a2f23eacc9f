"""The GPU tests compare fp32 runs of Triton kernels (fla's chunked gated delta rule among them) with
torch's fp32 arithmetic: Triton's fp32 dots must then be IEEE fp32, not its default tf32 (10-bit
mantissas, errors near 1e-3). Set here, before any kernel is compiled, so that `pytest tests/gpu` needs
no environment of its own; bf16 kernels are unaffected (their dots take bf16 operands)."""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_F32_DEFAULT", "ieee")
