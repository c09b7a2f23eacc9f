"""The chaos suite's fast part, in CI: manifest bombs, slowloris, poison requests beside innocent ones,
a prefill worker's engine core killed under streaming load (its shared KV unmapped by the decode
worker afterwards), and the router killed under load (every process gone, nothing left in /tmp: the
runtime's folder of lent cores is removed by the last worker out). `python bench/chaos.py` runs every
case (kill -9 and SIGSTOP of each process, the bad-input battery, SIGTERM under load) and prints the
summary table."""

from __future__ import annotations

import pytest
from chaos_cases import CASES, run_case, start_context

pytestmark = pytest.mark.slow

FAST = [c for c in CASES if c.fast]


@pytest.fixture(scope="module")
def ctx():
    context = start_context()
    yield context
    context.dep.stop()


@pytest.mark.parametrize("case", FAST, ids=[c.name for c in FAST])
def test_chaos(case, request):
    context = request.getfixturevalue("ctx") if case.shared else None
    result = run_case(case, context)
    print(f"{result.case}: {result.outcome} ({result.seconds:.1f}s)")
    assert result.passed, result.outcome
