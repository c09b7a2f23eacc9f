"""How long a worker's role change takes (runtime/role_switch.py), against the worker's own cold start.

Starts a disaggregated deployment (two prefill workers, one decode worker, the default SmolLM2-135M),
then moves `prefill-1` to decode and back `--changes` times with no load (so the drain is empty and the
figure is the change's own cost: stop the old engine core, start the new one, check the KV handshake).
Prints each phase's median, the whole change's median as the figure, and as the baseline the same
worker's first start (spawn to ready: interpreter, imports, weights, engine), measured in the same run.

    python bench/role_switch.py                  # 6 changes
    python bench/role_switch.py --changes 10
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from serve_harness import manifest_yaml, start_deployment  # noqa: E402

KEY = "sk-bench"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--changes", type=int, default=6)
    args = ap.parse_args()
    dep = start_deployment(manifest_yaml(mode="disaggregated", prefill={"replicas": 2}), api_key=KEY)
    try:
        first = {w["name"]: w for w in dep.admin()["workers"]}["prefill-1"]["startup_s"]
        phases: dict[str, list[float]] = {"drain": [], "reconfigure": [], "rejoin": [], "change": []}
        for i in range(args.changes):
            role = "decode" if i % 2 == 0 else "prefill"
            start = time.perf_counter()
            r = httpx.post(f"{dep.url}/admin/workers/prefill-1/role", json={"role": role, "reason": "bench"},
                           headers=dep.headers(), timeout=300)  # fmt: skip
            r.raise_for_status()
            phases["change"].append(time.perf_counter() - start)
            for phase in ("drain", "reconfigure", "rejoin"):
                phases[phase].append(r.json()[f"{phase}_s"])
            time.sleep(1.0)  # the next change starts from a settled worker
    finally:
        dep.stop()
    med = {k: statistics.median(v) for k, v in phases.items()}
    print(f"role change, median of {args.changes}: drain {med['drain']:.3f} s, reconfigure "
          f"{med['reconfigure']:.3f} s, rejoin {med['rejoin']:.3f} s")  # fmt: skip
    print(f"figure: a role change {med['change']:.2f} s; baseline: the worker's cold start {first:.2f} s; "
          f"ratio {med['change'] / first:.2f}x")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
