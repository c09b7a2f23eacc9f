"""nixl with VRAM: two processes on one GPU, KV registered on cuda:0, NIXL READs between them.

Setup: an exporter process (spawn) holds a KV cache of random bytes on --device and serves the nixl
transport (its whole pool registered with NIXL as VRAM); this process fetches into its own KV cache on
the same device (registered too). The baseline, measured in the same run, is `dst.copy_(src)` of the
same bytes between two buffers of that device in this process (the most one copy gets there).

  1. Ladder: payloads 1 MiB .. --max-mb (x4 steps), block ids one run on both sides ("contiguous":
     one descriptor) and random on both sides ("scattered": one descriptor per block). Median wall
     time of a whole fetch (control round trips included) over several repetitions after a warm-up.
  2. Qwen3-8B shape (36 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks): the KV of a
     --prompt-tokens prompt (4096: 256 blocks of 2.25 MiB, 576 MiB), contiguous and scattered.
Each row prints the NIXL backend that ran it (read back from NIXL) and the descriptors it took.

    python bench/nixl_gpu.py                          # cuda:0; ~3 GiB of it
    python bench/nixl_gpu.py --max-mb 64 --json /tmp/nixl_gpu.json
    python bench/nixl_gpu.py --device cpu --max-mb 16 # the same path with DRAM (a smoke test)

Install NIXL first without letting pip touch torch: `pip install --no-deps nixl-cu12==1.5.1 numpy`
(or the repacked wheel, docs/bench/kv-nixl.md).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from splitserve.transport import KVHandle, KVLayout, TransportOptions, make_transport  # noqa: E402

SECRET = os.environ.get("SPLITSERVE_KV_SECRET") or os.urandom(16).hex()
SMALL = {"num_layers": 16, "num_kv_heads": 4, "head_dim": 64, "block_size": 16}  # 256 KiB blocks
QWEN3_8B = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}  # 2.25 MiB blocks


@dataclass(frozen=True)
class Setup:
    device: str
    shape: dict
    num_blocks: int
    backends: tuple[str, ...]
    secret: str  # the child gets it here: a spawned process re-imports this module

    def layout(self) -> KVLayout:
        s = self.shape
        return KVLayout(
            "bench-nixl", "bfloat16", s["block_size"], s["num_layers"], s["num_kv_heads"], s["head_dim"]
        )

    def kv_cache(self) -> torch.Tensor:
        s = self.shape
        shape = (self.num_blocks, s["num_layers"], 2, s["block_size"], s["num_kv_heads"], s["head_dim"])
        return torch.empty(shape, dtype=torch.bfloat16, device=self.device)

    def options(self) -> TransportOptions:
        return TransportOptions(lease_s=3600, fetch_timeout_s=300, nixl_backends=self.backends)


def exporter_main(conn, setup_dict: dict) -> None:
    setup = Setup(**setup_dict)
    kv = setup.kv_cache()
    kv.view(torch.uint8).random_(0, 256)  # random bytes, every page touched
    t = make_transport("nixl", kv, setup.layout(), secret=setup.secret, options=setup.options())
    conn.send(("ready", msgspec.to_builtins(t.describe().nixl)))
    while True:
        cmd, *args = conn.recv()
        if cmd == "export":
            ids = args[0]
            conn.send(t.export(f"bench-{len(ids)}", ids, len(ids) * setup.shape["block_size"]).to_dict())
        elif cmd == "release":
            t.release(KVHandle.from_dict(args[0]))
            conn.send("ok")
        elif cmd == "stop":
            t.close()
            conn.send("bye")
            return


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)


def timed(fn, device: str, reps: int) -> float:
    """Median seconds of `fn` after one warm-up."""
    fn()
    sync(device)
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        sync(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def run_shape(setup: Setup, sizes_blocks: list[int], reps: int) -> list[dict]:
    ctx = mp.get_context("spawn")
    conn, child = ctx.Pipe()
    proc = ctx.Process(target=exporter_main, args=(child, asdict(setup)), daemon=True)
    proc.start()
    child.close()  # ours: so that the exporter's death reads as EOF, not as a wait forever
    died = "the exporter process died (exit code {}) before it was ready"
    while not conn.poll(1.0):
        if not proc.is_alive():
            raise SystemExit(died.format(proc.exitcode))
    try:
        status, exporter_nixl = conn.recv()
    except EOFError:
        proc.join(5)
        raise SystemExit(died.format(proc.exitcode)) from None
    assert status == "ready"
    kv = setup.kv_cache()
    kv.zero_()
    fetcher = make_transport("nixl", kv, setup.layout(), secret=setup.secret, options=setup.options())
    block = setup.layout().block_nbytes
    scratch = torch.empty(2, max(sizes_blocks) * block, dtype=torch.uint8, device=setup.device)
    rows = []
    gen = torch.Generator().manual_seed(0)
    try:
        for n in sizes_blocks:
            for pattern in ("contiguous", "scattered"):
                if pattern == "contiguous":
                    src, dst = list(range(n)), list(range(n))
                else:
                    src = torch.randperm(setup.num_blocks, generator=gen)[:n].tolist()
                    dst = torch.randperm(setup.num_blocks, generator=gen)[:n].tolist()
                conn.send(("export", src))
                handle = KVHandle.from_dict(conn.recv())
                seconds = timed(lambda h=handle, d=dst: fetcher.fetch(h, d), setup.device, reps)
                conn.send(("release", handle.to_dict()))
                assert conn.recv() == "ok"
                nbytes = n * block
                copy_s = timed(lambda b=nbytes: scratch[1, :b].copy_(scratch[0, :b]), setup.device, reps)
                info = fetcher.describe()
                rows.append(
                    {
                        "pattern": pattern,
                        "blocks": n,
                        "bytes": nbytes,
                        "nixl_gbps": nbytes / seconds / 1e9,
                        "copy_gbps": nbytes / copy_s / 1e9,
                        "backend": info.backend,
                        "descriptors": info.nixl.descriptors_last if info.nixl else None,
                        "memory": info.nixl.memory if info.nixl else None,
                    }
                )
                print(_row(rows[-1]), flush=True)
    finally:
        fetcher.close()
        conn.send(("stop",))
        conn.recv()
        proc.join(timeout=30)
    return rows


def _row(r: dict) -> str:
    size = f"{r['bytes'] / 2**20:.0f} MiB"
    return (
        f"{size:>9} {r['pattern']:>10} {r['blocks']:>6} blocks {r['descriptors']:>5} descs | "
        f"nixl {r['nixl_gbps']:7.2f} GB/s  copy {r['copy_gbps']:7.2f} GB/s  "
        f"{r['nixl_gbps'] / r['copy_gbps']:5.0%}  over {r['backend']} ({r['memory']})"
    )


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--max-mb", type=int, default=1024)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--nixl-backends", default="UCX")
    p.add_argument("--json", help="also write the rows here")
    args = p.parse_args(argv)
    backends = tuple(b for b in args.nixl_backends.split(",") if b)
    print(f"nixl on {args.device}: two processes, NIXL backends {list(backends)}", flush=True)
    small = Setup(args.device, SMALL, 0, backends, SECRET)
    block = small.layout().block_nbytes
    ladder, mb = [], 1
    while mb <= args.max_mb:
        ladder.append(max(1, (mb << 20) // block))
        mb *= 4
    rows = run_shape(Setup(args.device, SMALL, 2 * ladder[-1] + 8, backends, SECRET), ladder, args.reps)
    n = -(-args.prompt_tokens // QWEN3_8B["block_size"])
    print(f"Qwen3-8B shape, a {args.prompt_tokens}-token prompt: {n} blocks", flush=True)
    rows += run_shape(Setup(args.device, QWEN3_8B, 2 * n + 8, backends, SECRET), [n], args.reps)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
