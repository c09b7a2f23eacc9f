"""Where the CPU goes per streamed token: `splitserve serve` on random:tiny (one torch thread a worker),
32 parallel `curl` streams (32 x (128 in, 64 out), greedy, ignore_eos) passed over and over for
--seconds while py-spy samples every splitserve process; prints each process's busy CPU per output
token and the share of it spent writing to a socket, and the curl clients' CPU per token.

    python bench/profile_served.py                     # colocated
    python bench/profile_served.py --mode disaggregated

Needs py-spy (in the dev extra) and the right to ptrace the server's processes (root here). The raw
samples stay in --out (py-spy's raw format: one stack a line, then its count).
"""

from __future__ import annotations

import argparse
import os
import random
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.ab.curl_load import completion_body, run_curl  # noqa: E402

RATE_HZ = 200


def _summary(path: Path) -> tuple[float, float]:
    """-> (busy seconds, share of the samples inside a socket write) of one py-spy raw file."""
    total = writes = 0
    for line in path.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack:
            continue
        n = int(count)
        total += n
        leaf = stack.split(";")[-1]
        if "Transport.write" in leaf or "RequestResponseCycle.send" in leaf:
            writes += n
    return total / RATE_HZ, writes / max(total, 1)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="colocated", choices=("colocated", "disaggregated"))
    ap.add_argument("--seconds", type=float, default=12.0)
    ap.add_argument("--out", default="/tmp/splitserve-profile")
    args = ap.parse_args()
    spy = shutil.which("py-spy") or str(Path(sys.executable).parent / "py-spy")
    os.environ.setdefault("SPLITSERVE_KV_SECRET", os.urandom(16).hex())
    from splitserve.config import load_manifest
    from splitserve.runtime.process import start_serve

    knobs = {
        "model.source": "random:tiny", "model.max_model_len": 208, "engine.max_num_seqs": 32,
        "engine.max_num_batched_tokens": 2048, "engine.threads": 1, "engine.kv_cache_mb": 1024,
        "server.port": 0, "server.max_concurrent_requests": 256, "server.max_queued_requests": 256,
        "mode": args.mode,
    }  # fmt: skip
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    rng = random.Random(0)
    with start_serve(load_manifest(None, knobs)) as sp:
        model = sp.ready["model"]

        def one_pass() -> dict:
            prompts = [[rng.randint(3, 500) for _ in range(128)] for _ in range(32)]
            return run_curl(sp.url, [completion_body(model, p, 64) for p in prompts])

        one_pass()  # warm-up
        ps = subprocess.run(["ps", "-eo", "pid,args"], capture_output=True, text=True).stdout
        procs = {}
        for line in ps.splitlines():
            pid, _, cmd = line.strip().partition(" ")
            if "splitserve" in cmd and "--standby" not in cmd and "profile_served" not in cmd:
                procs[pid] = cmd.split(" --spec")[0][-60:]
        spies = [
            subprocess.Popen(
                [
                    spy,
                    "record",
                    "-p",
                    pid,
                    "-d",
                    str(int(args.seconds)),
                    "-r",
                    str(RATE_HZ),
                    "-f",
                    "raw",
                    "-o",
                    str(out / f"{pid}.txt"),
                    "--nonblocking",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )  # fmt: skip
            for pid in procs
        ]
        t0, passes, tokens, client_cpu = time.time(), 0, 0, 0.0
        while time.time() - t0 < args.seconds:
            run = one_pass()
            passes, tokens, client_cpu = passes + 1, tokens + run["tokens"], client_cpu + run["client_cpu_s"]
        for s in spies:
            s.wait()
    per_token = 1e6 * client_cpu / tokens
    print(f"{args.mode}: {passes} passes, {tokens} output tokens; curl: {per_token:.0f} us of CPU a token")
    for pid, cmd in procs.items():
        f = out / f"{pid}.txt"
        if f.exists() and f.stat().st_size:
            busy, write = _summary(f)
            print(f"  {cmd:<60} busy {busy:5.2f} s = {1e6 * busy / tokens:4.0f} us/token, "
                  f"{write:.0%} of it in socket writes")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
