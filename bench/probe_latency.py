"""verify's one-block latency taken apart (the goal: one 512 KiB block over cuda_ipc in <= 1 ms).
verify times one probe of one block, once, first: the decode worker times
`transport.fetch` of a probe export (the prefill worker leases free blocks and, for a hybrid model, a
copy of one state slot). Here the same probe is repeated (the first apart: connection, handles and
kernels on first use), and probes of more blocks give the per-fetch fixed cost against the per-byte.

    python bench/probe_latency.py --tokenizer TOKDIR          # random:qwen3.5-9b, cuda_ipc, started here
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too


async def measure(url: str, repeats: int, sizes: list[int]) -> None:
    import httpx

    from splitserve.router.probe import probe_pair
    from splitserve.wire.auth import worker_headers

    async with httpx.AsyncClient(
        timeout=60, headers=worker_headers(os.environ["SPLITSERVE_KV_SECRET"])
    ) as http:
        dep = (await http.get(f"{url}/admin/deployment")).json()
        p = next(w for w in dep["workers"] if w["role"] == "prefill")
        d = next(w for w in dep["workers"] if w["role"] == "decode")
        r = await http.post(f"{d['url']}/kv/connect", json={"address": p["kv_address"], "timeout_s": 10})
        r.raise_for_status()
        ones = []
        for _ in range(repeats):
            ones.append(await probe_pair(http, p["url"], d["url"], 1))
        ms = [x["seconds"] * 1e3 for x in ones]
        rest = ms[1:]
        print(f"1 block over {ones[0]['backend']}: first {ms[0]:.2f} ms, then median "
              f"{statistics.median(rest):.2f} (min {min(rest):.2f}, max {max(rest):.2f}) ms; "
              f"{ones[0]['bytes']} bytes counted")  # fmt: skip
        print(f"  each: {[round(x, 2) for x in ms]}")
        for n in sizes:
            runs = [await probe_pair(http, p["url"], d["url"], n) for _ in range(5)]
            t = statistics.median(x["seconds"] for x in runs)
            print(f"{n:5d} blocks ({runs[0]['bytes'] / 2**20:8.1f} MiB): median {t * 1e3:8.2f} ms, "
                  f"{runs[0]['bytes'] / t / 1e9:7.1f} GB/s", flush=True)  # fmt: skip
        s = (await http.get(f"{d['url']}/stats")).json()
        print("decode worker kv_transfer stats:", s.get("kv_transfer"))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="random:qwen3.5-9b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--kv-backend", default="cuda_ipc")
    ap.add_argument("--memory-utilization", type=float, default=0.4)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--sizes", type=int, nargs="+", default=[1, 4, 16, 64, 256])
    ap.add_argument("--url", default=None, help="a running deployment instead of starting one")
    args = ap.parse_args()
    os.environ.setdefault("SPLITSERVE_KV_SECRET", os.urandom(16).hex())
    if args.url:
        asyncio.run(measure(args.url, args.repeats, args.sizes))
        return 0
    from splitserve.config import load_manifest
    from splitserve.runtime.process import start_serve

    knobs = {"mode": "disaggregated", "model.source": args.model, "model.max_model_len": 4096,
             "server.port": 0, "transport.backend": args.kv_backend,
             "engine.memory_utilization": args.memory_utilization}  # fmt: skip
    if args.tokenizer:
        knobs["model.tokenizer"] = args.tokenizer
    with start_serve(load_manifest(None, knobs), timeout_s=400) as sp:
        print(f"ready: {sp.url}", flush=True)
        asyncio.run(measure(sp.url, args.repeats, args.sizes))
    return 0


if __name__ == "__main__":
    sys.exit(main())
