"""Each worker's device memory against its share, sampled while a load runs (CUDA, NVML through
nvidia-smi): does `engine.memory_utilization` bound the whole worker process?

    python bench/memory_share.py --share 0.45 -- python bench/hybrid_served.py --modes disaggregated \
        --tokenizer TOKDIR --memory-utilization 0.45 --cuda-mps off --no-verify --ttft-reps 1 --repeats 1 \
        --prefix-reqs 0

Runs the command after `--`, samples `nvidia-smi --query-compute-apps=pid,used_memory` every
`--interval-ms` until it ends, and prints, per process that held device memory, its role (the
`--role` of the nearest ancestor that names one), its peak, the share (`--share` x the device's
memory, or `--share-gib`) and the ratio; the exit status is the command's, or 3 when a worker went over.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from pathlib import Path


def _query(args: list[str]) -> list[list[str]]:
    out = subprocess.run(
        ["nvidia-smi", *args, "--format=csv,noheader,nounits"], capture_output=True, text=True
    )
    return [[f.strip() for f in line.split(",")] for line in out.stdout.splitlines() if line.strip()]


def role_of(pid: int) -> str:
    """The `--role` of the process or its nearest ancestor that has one ("?" if none)."""
    for _ in range(6):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:
            return "?"
        words = [a.decode(errors="replace") for a in argv]
        if "--role" in words and words.index("--role") + 1 < len(words):
            return words[words.index("--role") + 1]
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid <= 1:
            return "?"
        pid = ppid
    return "?"


class Sampler(threading.Thread):
    def __init__(self, interval_s: float) -> None:
        super().__init__(daemon=True)
        self.interval_s, self.stop = interval_s, threading.Event()
        self.peaks: dict[int, int] = {}  # pid -> MiB
        self.roles: dict[int, str] = {}
        self.samples = 0
        self.device_peak = 0  # MiB used on the device, all processes

    def run(self) -> None:
        while not self.stop.is_set():
            for pid_s, mib_s in _query(["--query-compute-apps=pid,used_memory"]):
                if not pid_s.isdigit() or not mib_s.isdigit():
                    continue
                pid, mib = int(pid_s), int(mib_s)
                if pid not in self.roles:
                    self.roles[pid] = role_of(pid)
                self.peaks[pid] = max(self.peaks.get(pid, 0), mib)
            used = _query(["--query-gpu=memory.used"])
            if used and used[0][0].isdigit():  # the whole device too (where per-process figures are missing)
                self.device_peak = max(self.device_peak, int(used[0][0]))
            self.samples += 1
            self.stop.wait(self.interval_s)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--share", type=float, default=None, help="each worker's memory_utilization")
    ap.add_argument("--share-gib", type=float, default=None, help="each worker's share in GiB instead")
    ap.add_argument("--interval-ms", type=int, default=200)
    ap.add_argument("command", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    cmd = args.command[1:] if args.command[:1] == ["--"] else args.command
    total_mib = int(_query(["--query-gpu=memory.total"])[0][0])
    share_mib = args.share_gib * 1024 if args.share_gib else (args.share or 0.9) * total_mib
    sampler = Sampler(args.interval_ms / 1e3)
    sampler.start()
    t0 = time.perf_counter()
    rc = subprocess.call(cmd)
    sampler.stop.set()
    sampler.join()
    print(
        f"memory share: {sampler.samples} samples in {time.perf_counter() - t0:.0f} s; "
        f"device {total_mib} MiB; share {share_mib:.0f} MiB a worker"
    )
    over = False
    for pid, peak in sorted(sampler.peaks.items(), key=lambda kv: -kv[1]):
        ratio = peak / share_mib
        over |= ratio > 1.0 and sampler.roles[pid] != "?"
        print(
            f"  pid {pid} ({sampler.roles[pid]}): peak {peak} MiB, share {share_mib:.0f} MiB, "
            f"ratio {ratio:.3f}"
        )
    print(f"  the whole device: peak {sampler.device_peak} MiB used")
    verdict = "a worker went OVER its share" if over else "every worker stayed inside its share"
    print(f"  command exit {rc}; {verdict}")
    return rc or (3 if over else 0)


if __name__ == "__main__":
    sys.exit(main())
