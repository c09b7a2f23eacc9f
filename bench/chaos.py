"""The chaos suite, every case, from one command; prints the summary table (case, expected, outcome,
passed or failed; totals) and exits 1 if any case failed.

    python bench/chaos.py             # all cases (about 10 min on 2 CPU cores)
    python bench/chaos.py --fast      # only the CI cases (tests/chaos/test_chaos.py)
    python bench/chaos.py --only stop # cases whose name contains "stop"

The cases and their checks live in tests/chaos/ (chaos_cases.py, chaos_harness.py): kill -9 and
SIGSTOP of each worker process (front end, engine core) of a disaggregated deployment under
streaming load, SIGSTOP and kill -9 of the router, poison requests beside innocent ones, the
bad-input battery, slowloris, manifest bombs, SIGTERM under load. After each: 0 hung, 0 wrong tokens
(against a greedy reference taken before any fault), pools full, no temp folders or KV mappings left.
Every process a case starts is stopped before the command ends.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "chaos"))

from chaos_cases import CASES, run_case, start_context  # noqa: E402
from chaos_harness import Context, Result, table  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", action="store_true", help="only the cases CI runs")
    ap.add_argument("--only", default="", help="only cases whose name contains this")
    args = ap.parse_args()
    cases = [c for c in CASES if (c.fast or not args.fast) and args.only in c.name]
    ctx: Context | None = None
    results: list[Result] = []
    t0 = time.monotonic()
    try:
        for case in cases:
            if case.shared and ctx is None:
                print("starting the shared deployment ...", flush=True)
                ctx = start_context()
            result = run_case(case, ctx if case.shared else None)
            results.append(result)
            print(f"[{'passed' if result.passed else 'FAILED'}] {result.case}: {result.outcome} "
                  f"({result.seconds:.1f}s)", flush=True)  # fmt: skip
    finally:
        if ctx is not None:
            ctx.dep.stop()
    print()
    print(table(results))
    print(f"in {time.monotonic() - t0:.0f}s")
    return 0 if all(r.passed for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
