"""engine/cpu_heap.py: with freed memory kept, a step's large temporaries reuse mapped pages. A probe
process allocates what prefill steps of varying sizes do (each layer's outputs, written, then freed);
after a first round, glibc's defaults still fault in ~90,000 pages over three more rounds (it maps and
trims them anew), with the memory kept ~4,000."""

from __future__ import annotations

import subprocess
import sys

import pytest

_PROBE = """
import resource, sys, torch
from splitserve.engine import cpu_heap
if sys.argv[1] == "1":
    assert cpu_heap.keep_freed_memory()
def round_():
    for tokens in (2048, 1500, 2048, 700, 2048):  # steps of different sizes
        h = torch.empty(tokens, 576).fill_(1.0)
        for _ in range(3):  # layers
            qkv = torch.empty(tokens, 960).fill_(1.0)
            q = torch.empty(tokens, 576).fill_(1.0); del qkv
            o = torch.empty(tokens, 576).fill_(1.0); del q
            gu = torch.empty(tokens, 3072).fill_(1.0)
            a = torch.empty(tokens, 1536).fill_(1.0); del gu
            h = torch.empty(tokens, 576).fill_(1.0); del a, o
round_()
f0 = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(3):
    round_()
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - f0)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc")
def test_kept_memory_is_reused_without_page_faults() -> None:
    def faults(keep: str) -> int:
        out = subprocess.run([sys.executable, "-c", _PROBE, keep], capture_output=True, text=True, check=True)
        return int(out.stdout.strip())

    kept, default = faults("1"), faults("0")
    assert kept * 5 < default, (kept, default)
