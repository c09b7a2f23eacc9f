"""KV transfer bandwidth and latency per transport, beside raw baselines measured in the same run.

Setup: an exporter in another OS process (spawn) holds a KV tensor with random bytes and serves tcp and
shm; this process is the fetcher, with its own KV tensor (pages touched up front, as in a running
engine). Block ids are random on both sides, so no two blocks of a payload are adjacent in memory.

For each payload size (1 MiB, x4 steps, up to --max-mb):
  tcp   fetch(handle, into_block_ids) of that many bytes, against a raw loopback socket between the
        same two processes: the exporter `sendall`s the same bytes on a 1-byte request and this process
        `recv_into`s them into its KV memory.
  shm   fetch over shared memory, against one plain memcpy (numpy copyto) of the same bytes here;
        twice: "shm staged" (the exporter's KV is ordinary memory: two copies through slots) and
        "shm direct" (its KV was allocated with allocate_shared_kv: the fetcher copies out of it).
  nixl  fetch over NIXL (UCX here; `--nixl-backends`): one READ per fetch of one descriptor per run
        of blocks consecutive on both sides (random ids: one per block, the worst case), against the
        same raw loopback socket as tcp. Skipped, and said so, where NIXL is not installed.
Each figure is the median of several repetitions after one warm-up; the ratio is to the baseline.
Latency: median round trip of a 1-block fetch, against the raw socket / memcpy of the same bytes.
Goals: tcp and nixl >= 70% of the raw socket, shm >= 50% of memcpy, judged on payloads >= 64 MiB (a 512-token
prompt of an 8B model); below that a fetch's fixed round trips (~0.3-0.5 ms here) dominate, and the
memcpy baseline runs from cache.

Examples:
    python bench/kv_transfer.py                      # 1 MiB .. 1 GiB (about 4.2 GB of memory)
    python bench/kv_transfer.py --max-mb 64 --reps 5
    python bench/kv_transfer.py --checksum crc32     # with payload checksums
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import msgspec
import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from splitserve.transport import BackendUnavailable, KVHandle, KVLayout, TransportOptions, make_transport  # noqa: E402
from splitserve.transport.nixl.env import load_nixl  # noqa: E402
from splitserve.transport.payload import tensor_bytes  # noqa: E402
from splitserve.transport.stream.shm import allocate_shared_kv  # noqa: E402

TRANSPORTS = {"tcp": "raw_socket", "shm staged": "memcpy", "shm direct": "memcpy", "nixl": "raw_socket"}
GOALS = {"tcp": 0.70, "shm staged": 0.50, "shm direct": 0.50, "nixl": 0.70}
BULK_BYTES = 64 << 20  # goals are judged on payloads at least this large (bandwidth, not round trips)


@dataclass(frozen=True)
class Setup:
    num_layers: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: str
    num_blocks: int
    checksum: str | None
    secret: str
    nixl_backends: tuple[str, ...] | None = None  # None: no nixl rows

    def layout(self) -> KVLayout:
        return KVLayout(
            "bench", self.dtype, self.block_size, self.num_layers, self.num_kv_heads, self.head_dim
        )

    def kv_cache(self, shared: bool = False) -> torch.Tensor:
        shape = (self.num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)
        dtype = getattr(torch, self.dtype)
        return allocate_shared_kv(shape, dtype) if shared else torch.empty(shape, dtype=dtype)

    def options(self) -> TransportOptions:
        return TransportOptions(
            checksum=self.checksum,
            lease_s=3600,
            fetch_timeout_s=300,
            nixl_backends=self.nixl_backends or ("UCX",),
        )

    def transports(self) -> dict[str, str]:
        """Row name -> its baseline, for the transports this run measures."""
        return {k: v for k, v in TRANSPORTS.items() if k != "nixl" or self.nixl_backends}


# -- the exporter process -------------------------------------------------------------------------
def exporter_main(conn, setup_dict: dict) -> None:
    setup = Setup(**setup_dict)
    private, shared = setup.kv_cache(), setup.kv_cache(shared=True)
    raw, rng = tensor_bytes(shared), np.random.default_rng(0)
    for start in range(0, raw.nbytes, 64 << 20):  # random bytes; touches every page
        chunk = raw[start : start + (64 << 20)]
        chunk[:] = rng.integers(0, 256, chunk.nbytes, dtype=np.uint8)
    private.copy_(shared)
    caches = {"tcp": ("tcp", shared), "shm staged": ("shm", private), "shm direct": ("shm", shared)}
    if setup.nixl_backends:
        caches["nixl"] = ("nixl", shared)
    transports = {
        name: make_transport(backend, kv, setup.layout(), secret=setup.secret, options=setup.options())
        for name, (backend, kv) in caches.items()
    }
    rng = np.random.default_rng(1)
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "export":
            backend, n = args
            ids = rng.permutation(setup.num_blocks)[:n].tolist()
            conn.send(transports[backend].export(f"bench-{n}", ids, n * setup.block_size).to_dict())
        elif cmd == "release":
            transports[args[0]].release(KVHandle.from_dict(args[1]))
            conn.send("ok")
        elif cmd == "raw_send":
            port, nbytes, reps = args
            with socket.create_connection(("127.0.0.1", port)) as sock:
                for _ in range(reps):
                    sock.recv(1)
                    sock.sendall(raw[:nbytes])
            conn.send("ok")
        elif cmd == "stop":
            for t in transports.values():
                t.close()
            conn.send("bye")
            return


class Exporter:
    def __init__(self, setup: Setup) -> None:
        self.setup = setup
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=exporter_main, args=(child, asdict(setup)), daemon=True)
        self.proc.start()
        assert self.conn.recv() == "ready"

    @property
    def block_nbytes(self) -> int:
        return self.setup.layout().block_nbytes

    def call(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def stop(self) -> None:
        self.call("stop")
        self.proc.join(timeout=30)


# -- measurements ---------------------------------------------------------------------------------
class RawSocket:
    """The tcp baseline: the exporter process sendall()s `nbytes` of its KV memory per 1-byte request."""

    def __init__(self, exporter: Exporter, dst: np.ndarray, nbytes: int, rounds: int) -> None:
        self.exporter, self.view, self.nbytes = exporter, memoryview(dst)[:nbytes], nbytes
        with socket.create_server(("127.0.0.1", 0)) as listener:
            exporter.conn.send(("raw_send", listener.getsockname()[1], nbytes, rounds))
            self.sock, _ = listener.accept()

    def once(self) -> None:
        self.sock.sendall(b"x")
        got = 0
        while got < self.nbytes:
            got += self.sock.recv_into(self.view[got:])

    def close(self) -> None:
        self.sock.close()
        assert self.exporter.conn.recv() == "ok"


def alternate(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """One warm-up each, then `reps` rounds taking every contender in turn (so that load on the
    machine drifting during the run hits them all alike)."""
    for once in runs.values():
        once()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, once in runs.items():
            start = time.perf_counter()
            once()
            times[name].append(time.perf_counter() - start)
    return times


def measure(
    exporter: Exporter, fetchers: dict, src: np.ndarray, dst: np.ndarray, n: int, reps: int, rng
) -> dict:
    """Seconds per transfer of `n` blocks for every transport and both baselines."""
    nbytes = n * exporter.block_nbytes
    handles = {name: KVHandle.from_dict(exporter.call("export", name, n)) for name in fetchers}
    into = rng.permutation(dst.nbytes // exporter.block_nbytes)[:n].tolist()
    raw = RawSocket(exporter, dst, nbytes, reps + 1)
    runs: dict[str, Callable[[], object]] = {
        name: (lambda f=fetcher, h=handles[name]: f.fetch(h, into)) for name, fetcher in fetchers.items()
    }
    runs["raw_socket"] = raw.once
    runs["memcpy"] = lambda: np.copyto(dst[:nbytes], src[:nbytes])
    try:
        return alternate(runs, reps)
    finally:
        raw.close()
        for name, handle in handles.items():
            exporter.call("release", name, handle.to_dict())


def gbps(nbytes: int, times: list[float]) -> float:
    return nbytes / statistics.median(times) / 1e9


# -- the run --------------------------------------------------------------------------------------
def run(args: argparse.Namespace) -> dict:
    setup = make_setup(args)
    block = setup.layout().block_nbytes
    sizes = [mb << 20 for mb in size_ladder(args.max_mb)]
    exporter = Exporter(setup)
    kv = setup.kv_cache()  # one fetcher cache shared by the fetcher transports (they run one at a time)
    dst, src = tensor_bytes(kv), np.ones(sizes[-1], dtype=np.uint8)
    dst.fill(0)  # touch the pages, as in a running engine
    by_backend = {
        b: make_transport(b, kv, setup.layout(), secret=setup.secret, options=setup.options())
        for b in ("tcp", "shm", *(("nixl",) if setup.nixl_backends else ()))
    }
    fetchers = {name: by_backend[name.split()[0]] for name in setup.transports()}
    rng = np.random.default_rng(2)
    rows, progress = [], make_progress(len(sizes) + 1)
    try:
        for nbytes in sizes:
            n, reps = nbytes // block, args.reps or max(5, min(20, (256 << 20) // nbytes))
            times = measure(exporter, fetchers, src, dst, n, reps, rng)
            rows.append(
                {
                    "bytes": n * block,
                    "blocks": n,
                    "reps": reps,
                    **{k: gbps(n * block, t) for k, t in times.items()},
                }
            )
            progress.update(1)
        times = measure(exporter, fetchers, src, dst, 1, 50, rng)
        latency = {"block_bytes": block, **{k: 1e3 * statistics.median(t) for k, t in times.items()}}
        progress.update(1)
    finally:
        progress.close()
        described = {b: msgspec.to_builtins(t.describe()) for b, t in by_backend.items()}
        for t in by_backend.values():
            t.close()
        exporter.stop()
    return {"setup": asdict(setup), "rows": rows, "latency": latency, "describe": described}


def make_setup(args: argparse.Namespace) -> Setup:
    probe = Setup(args.layers, args.block_size, args.kv_heads, args.head_dim, args.dtype, 1, None, "")
    block = probe.layout().block_nbytes
    largest = size_ladder(args.max_mb)[-1] << 20
    num_blocks = largest // block + 8
    secret = os.environ.get("SPLITSERVE_KV_SECRET") or os.urandom(16).hex()
    nixl = tuple(b for b in args.nixl_backends.split(",") if b) or None
    if nixl:
        try:
            load_nixl()
        except BackendUnavailable as exc:
            print(f"no nixl rows: {exc}", file=sys.stderr)
            nixl = None
    return Setup(args.layers, args.block_size, args.kv_heads, args.head_dim, args.dtype, num_blocks,
                 args.checksum, secret, nixl)  # fmt: skip


def size_ladder(max_mb: int) -> list[int]:
    sizes, mb = [], 1
    while mb <= max_mb:
        sizes.append(mb)
        mb *= 4
    return sizes


def make_progress(total: int):
    try:
        from tqdm import tqdm

        return tqdm(total=total, desc="kv transfer", unit="size", file=sys.stderr)
    except ImportError:  # tqdm is optional
        return _NoProgress()


class _NoProgress:
    def update(self, n: int) -> None: ...

    def close(self) -> None: ...


def report(result: dict) -> str:
    transports = Setup(**result["setup"]).transports()
    columns = [*transports, "raw_socket", "memcpy"]
    head = " ".join(f"{c:>10}" for c in columns) + " | " + " ".join(f"{c + ' %':>12}" for c in transports)
    lines = [f"{'payload':>10} {'blocks':>6} | {head}   (GB/s; % of its baseline)"]
    for r in result["rows"]:
        figures = " ".join(f"{r[c]:10.2f}" for c in columns)
        ratios = " ".join(f"{r[t] / r[base]:12.0%}" for t, base in transports.items())
        lines.append(f"{_size(r['bytes']):>10} {r['blocks']:>6} | {figures} | {ratios}")
    lat = result["latency"]
    lines.append(
        f"latency of a 1-block fetch ({_size(lat['block_bytes'])}, median of 50): "
        + ", ".join(f"{c} {lat[c]:.3f} ms" for c in columns)
    )
    for name, base in transports.items():
        bulk = [r[name] / r[base] for r in result["rows"] if r["bytes"] >= BULK_BYTES]
        if bulk:
            verdict = "PASS" if min(bulk) >= GOALS[name] else "FAIL"
            lines.append(
                f"goal: {name} >= {GOALS[name]:.0%} of {base} on payloads >= {_size(BULK_BYTES)}: "
                f"min {min(bulk):.0%}, median {statistics.median(bulk):.0%} -> {verdict}"
            )
    for backend, info in result["describe"].items():
        lines.append(
            f"describe[{backend}]: backend={info['backend']} fetches={info['counts'].get('fetches')} "
            f"recent={info['fetch_gbps_recent']} GB/s checksum={result['setup']['checksum']}"
            + (f" nixl={info['nixl']}" if "nixl" in info else "")
        )
    return "\n".join(lines)


def _size(nbytes: int) -> str:
    return f"{nbytes / 2**30:g} GiB" if nbytes >= 2**30 else f"{nbytes / 2**20:g} MiB"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-mb", type=int, default=1024, help="largest payload in MiB (memory ~3x this)")
    p.add_argument("--reps", type=int, default=0, help="repetitions per size (default: by size)")
    p.add_argument("--checksum", choices=["crc32", "blake2b"], default=None)
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--nixl-backends", default="UCX", help='NIXL backends for the nixl rows ("" for none)')
    p.add_argument("--json", help="also write the raw results here")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    result = run(args)
    print(report(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
