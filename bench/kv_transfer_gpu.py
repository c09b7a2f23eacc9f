"""GPU KV transfer: cuda_ipc and nccl between two GPUs of one host, beside a raw GPU-to-GPU copy.

Setup: an exporter process (spawn) holds KV caches of random bytes on cuda:0 and serves cuda_ipc and
nccl; this process fetches into its own KV caches on cuda:1. The baseline, measured in the same run,
is `dst.copy_(src)` of the same number of bytes from a cuda:0 buffer to a cuda:1 buffer in this
process (the copy engines over NVLink / PCIe: the most one cudaMemcpy gets).

  1. Ladder: payloads 1 MiB .. --max-mb (x4 steps) of a small-block layout (default 256 KiB blocks),
     block ids one run on both sides ("contiguous") and random on both sides ("scattered"). Each
     figure is the median wall time of a whole synchronous fetch (nccl's control round trip included;
     cuda_ipc reads one-sided, checking the exporter's lease board) over several repetitions after a
     warm-up, the contenders taking turns; the ratio is to the raw copy.
     "cuda_ipc/runs" is cuda_ipc forced to one cudaMemcpy per block run (scattered only), to show
     why many runs go through the block-copy kernel instead; "cuda_ipc/kernel" is the kernel forced
     on one run (contiguous only), beside the single cudaMemcpy (copy engines) used there.
  2. Latency: median of a 1-block fetch.
  3. Qwen3-8B shape (36 layers, 8 KV heads, head_dim 128, bf16, 16-token blocks): the KV of a
     --prompt-tokens prompt, fetched over both backends, against the prefill time of that prompt on
     one GPU (splitserve's engine on random weights of that shape, `qwen3-8b-random`, one prefill
     step: max_num_batched_tokens = prompt length, no prefix caching).

Goals: >= 85% of the raw copy on payloads >= 64 MiB; prompt KV transfer <= 5% of its prefill time.

    python bench/kv_transfer_gpu.py                       # needs 2 GPUs; ~3 GiB of each
    python bench/kv_transfer_gpu.py --max-mb 256 --skip-prefill --json /tmp/kv_gpu.json
    python bench/kv_transfer_gpu.py --trace               # + each row's fetch timelines (transport/trace.py)
    python bench/kv_transfer_gpu.py --sweep-ce            # + copy-engine copies by hand, 1-8 streams
    python bench/kv_transfer_gpu.py --same-gpu            # one GPU: a smoke test of cuda_ipc's path
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import msgspec
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

import splitserve.transport.gpu.blocks as gpu_blocks  # noqa: E402
from splitserve.transport import KVHandle, KVLayout, TransportOptions, make_transport, trace  # noqa: E402

BACKENDS = ("cuda_ipc", "nccl")
FETCH = "cuda:1"  # the fetcher's GPU; --same-gpu: cuda:0 (a smoke test on one GPU: cuda_ipc only)
BULK_BYTES = 64 << 20
GOAL_RATIO = 0.85
GOAL_PREFILL = 0.05
SECRET = os.environ.get("SPLITSERVE_KV_SECRET") or os.urandom(16).hex()  # the child gets it in its args
QWEN3_8B = {"num_layers": 36, "num_kv_heads": 8, "head_dim": 128, "block_size": 16}


def layout_of(shape: dict) -> KVLayout:
    return KVLayout("bench-gpu", "bfloat16", shape["block_size"], shape["num_layers"], shape["num_kv_heads"],
                    shape["head_dim"])  # fmt: skip


def kv_shape(shape: dict, num_blocks: int) -> tuple[int, ...]:
    return (num_blocks, shape["num_layers"], 2, shape["block_size"], shape["num_kv_heads"], shape["head_dim"])


def options() -> TransportOptions:
    return TransportOptions(lease_s=3600, fetch_timeout_s=120)


# -- the exporter process -------------------------------------------------------------------------
def exporter_main(conn, caches: dict[str, tuple[dict, int]], secret: str, tracing: bool) -> None:
    global SECRET
    SECRET = secret
    trace.ON = tracing
    torch.cuda.set_device(0)
    kvs, transports = {}, {}
    for name, (shape, num_blocks) in caches.items():
        kv = torch.empty(kv_shape(shape, num_blocks), dtype=torch.bfloat16, device="cuda:0")
        raw = kv.view(-1).view(torch.uint8)
        gen = torch.Generator(device="cuda:0").manual_seed(0)
        for at in range(0, raw.numel(), 256 << 20):
            part = raw[at : at + (256 << 20)]
            part.copy_(torch.randint(0, 256, part.shape, dtype=torch.uint8, device="cuda:0", generator=gen))
        kvs[name] = kv
        for b in BACKENDS:
            transports[name, b] = make_transport(b, kv, layout_of(shape), secret=SECRET, options=options())
            transports[name, b].listen()
    torch.cuda.synchronize()
    conn.send("ready")
    while True:
        cmd, *args = conn.recv()
        if cmd == "export":
            name, backend, ids = args
            n = len(ids) * caches[name][0]["block_size"]
            conn.send(transports[name, backend].export(f"bench-{len(ids)}", ids, n).to_dict())
        elif cmd == "release":
            name, backend, handle = args
            transports[name, backend].release(KVHandle.from_dict(handle))
            conn.send("ok")
        elif cmd == "digest":
            name, ids = args
            conn.send(digest(kvs[name], ids))
        elif cmd == "nccl_raw":
            port, prefix, sizes, reps = args
            conn.send(nccl_raw_side(0, port, prefix, sizes, reps, kvs["ladder"].view(-1).view(torch.uint8)))
        elif cmd == "phases":  # the exporter's serve phases since the last call, per backend
            out = {}
            for b in BACKENDS:
                out[b] = transports[args[0], b].describe().serve_phases_ms
                transports[args[0], b].mover.serve_phases.clear()
            conn.send(out)
        elif cmd == "trace":
            conn.send(trace.events())
        elif cmd == "describe":
            conn.send({f"{n}/{b}": msgspec.to_builtins(t.describe()) for (n, b), t in transports.items()})
        elif cmd == "stop":
            for t in transports.values():
                t.close()
            conn.send("bye")
            return


def digest(kv: torch.Tensor, ids: list[int]) -> int:
    """A cheap fingerprint of kv[ids] (sum of its int32 words, weighted by position in the payload)."""
    rows = gpu_blocks.kv_rows(kv)
    total = 0
    for i, b in enumerate(ids):
        total += (i + 1) * int(rows[b].view(torch.int32).sum(dtype=torch.int64).item())
    return total


NCCL_PROBES = {"default": {}, "min_ctas=32": {"min_ctas": 32, "max_ctas": 32}}


def nccl_raw_side(rank: int, port: int, prefix: str, sizes: list[int], reps: int, buf: torch.Tensor) -> dict:
    """Plain NCCL send (rank 0) / recv (rank 1) of `sizes` bytes, `reps` + 1 times each, per probe
    config: the NCCL ceiling the nccl transport works under. -> {probe: {nbytes: [seconds]}}."""
    from datetime import timedelta

    import torch.distributed as dist

    from splitserve.transport.gpu.nccl_group import make_group

    device = torch.device("cuda", rank)
    store = dist.TCPStore("127.0.0.1", port, None, False, timedelta(seconds=120), False)
    out: dict = {}
    for probe, config in NCCL_PROBES.items():
        try:
            group = make_group(dist.PrefixStore(f"{prefix}/{probe}", store), rank, device, 300, config)
        except Exception as exc:  # noqa: BLE001 - a config this NCCL does not take
            out[probe] = {"error": f"{type(exc).__name__}: {exc}"}
            continue
        times: dict[int, list[float]] = {}
        with torch.cuda.device(device):
            for nbytes in sizes:
                times[nbytes] = []
                for _ in range(reps + 1):
                    start = time.perf_counter()
                    op = group.send if rank == 0 else group.recv
                    op([buf[:nbytes]], 1 - rank, 0).wait()
                    torch.cuda.synchronize(device)
                    times[nbytes].append(time.perf_counter() - start)
        group.abort()
        out[probe] = {n: ts[1:] for n, ts in times.items()}
    return out


def nccl_raw(exporter: Exporter, buf: torch.Tensor, sizes: list[int], reps: int) -> dict:
    """The parent's side of nccl_raw_side: it receives; -> {probe: {nbytes: {gbps, ms}}}."""
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, None, True, timedelta(seconds=120), False)
    prefix = os.urandom(8).hex()
    exporter.conn.send(("nccl_raw", store.port, prefix, sizes, reps))
    mine = nccl_raw_side(1, store.port, prefix, sizes, reps, buf)
    exporter.conn.recv()
    out: dict = {}
    for probe, by_size in mine.items():
        if "error" in by_size:
            out[probe] = by_size
            continue
        out[probe] = {n: {"gbps": n / statistics.median(ts) / 1e9, "ms": 1e3 * statistics.median(ts)}
                      for n, ts in by_size.items()}  # fmt: skip
    return out


class Exporter:
    def __init__(self, caches: dict[str, tuple[dict, int]]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=exporter_main, args=(child, caches, SECRET, trace.ON), daemon=True)
        self.proc.start()
        if not self.conn.poll(300) or self.conn.recv() != "ready":
            raise RuntimeError("exporter process did not start")

    def call(self, *cmd):
        self.conn.send(cmd)
        return self.conn.recv()

    def export(self, name: str, backend: str, ids: list[int]) -> KVHandle:
        return KVHandle.from_dict(self.call("export", name, backend, ids))

    def stop(self) -> None:
        self.call("stop")
        self.proc.join(timeout=30)


# -- measurements ---------------------------------------------------------------------------------
def sync() -> None:
    torch.cuda.synchronize(0)
    torch.cuda.synchronize(FETCH)


def alternate(runs: dict[str, Callable[[], object]], reps: int) -> dict[str, list[float]]:
    """One warm-up each, then `reps` rounds taking every contender in turn."""
    for once in runs.values():
        once()
    times: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(reps):
        for name, once in runs.items():
            start = time.perf_counter()
            once()
            times[name].append(time.perf_counter() - start)
    return times


class Fetchers:
    """This process's side: a KV cache on cuda:1 and a fetcher per backend for each cache."""

    def __init__(self, caches: dict[str, tuple[dict, int]], raw_bytes: int) -> None:
        self.caches = caches
        self.kv_cache = {
            name: torch.zeros(kv_shape(shape, n), dtype=torch.bfloat16, device=FETCH)
            for name, (shape, n) in caches.items()
        }
        self.t = {
            (name, b): make_transport(
                b, self.kv_cache[name], layout_of(shape), secret=SECRET, options=options()
            )
            for name, (shape, _) in caches.items()
            for b in BACKENDS
        }
        self.raw_src = torch.empty(raw_bytes, dtype=torch.uint8, device="cuda:0").fill_(7)
        self.raw_dst = torch.empty(raw_bytes, dtype=torch.uint8, device=FETCH)

    def raw_copy(self, nbytes: int) -> None:
        self.raw_dst[:nbytes].copy_(self.raw_src[:nbytes])
        sync()

    def close(self) -> None:
        for t in self.t.values():
            t.close()


def block_ids(pattern: str, n: int, num_blocks: int, gen: torch.Generator) -> tuple[list[int], list[int]]:
    """Exporter and fetcher block ids: one run on both sides ("contiguous"), or random on both."""
    if pattern == "contiguous":
        return list(range(3, 3 + n)), list(range(num_blocks - n - 1, num_blocks - 1))
    ids = torch.randperm(num_blocks, generator=gen)[:n].tolist()
    return ids, torch.randperm(num_blocks, generator=gen)[:n].tolist()


def sweep_row(label: str, times: dict[str, list[float]], nbytes: int, **fields) -> dict:  # noqa: ANN003
    """A sweep's contenders as GB/s and share of the raw copy (printed on one line); + `fields`."""
    raw = statistics.median(times["raw_copy"])
    row: dict = dict(fields)
    for k, ts in times.items():
        row[k] = {"gbps": nbytes / statistics.median(ts) / 1e9, "of_raw": raw / statistics.median(ts)}
    figs = [f"{k} {v['gbps']:.0f} GB/s ({v['of_raw']:.0%})" for k, v in row.items() if isinstance(v, dict)]
    print(f"  {label}: " + ", ".join(figs), flush=True)
    return row


def measure(
    exporter: Exporter, fetchers: Fetchers, name: str, n: int, pattern: str, reps: int, gen: torch.Generator
) -> dict:
    shape, num_blocks = fetchers.caches[name]
    block = layout_of(shape).block_nbytes
    ids, into = block_ids(pattern, n, num_blocks, gen)
    handles = {b: exporter.export(name, b, ids) for b in BACKENDS}
    runs: dict[str, Callable[[], object]] = {
        b: (lambda b=b: fetchers.t[name, b].fetch(handles[b], into)) for b in BACKENDS
    }
    ipc = fetchers.t[name, "cuda_ipc"]
    if pattern == "scattered" and n > 1:  # one cudaMemcpy per run instead of the kernel
        runs["cuda_ipc/runs"] = lambda: fetch_forced(ipc, handles["cuda_ipc"], into, RUNS)
    if pattern == "contiguous" and n > 1:  # the block-copy kernel instead of one cudaMemcpy
        runs["cuda_ipc/kernel"] = lambda: fetch_forced(ipc, handles["cuda_ipc"], into, KERNEL)
    runs["raw_copy"] = lambda: fetchers.raw_copy(n * block)
    for b in BACKENDS:
        fetchers.t[name, b].mover.phases.clear()
    exporter.call("phases", name)
    try:
        times = alternate(runs, reps)
        timelines = traced(exporter, fetchers, name, handles, into) if trace.ON else None
        phases = {b: fetchers.t[name, b].describe().fetch_phases_ms for b in BACKENDS}
        phases["exporter"] = exporter.call("phases", name)
        check = None
        if n * block >= BULK_BYTES or n == 1:  # the bytes that arrived are the exporter's
            want = exporter.call("digest", name, ids)
            check = {}
            for b in BACKENDS:
                fetchers.t[name, b].fetch(handles[b], into)
                check[b] = digest(fetchers.kv_cache[name], into) == want
    finally:
        for b, h in handles.items():
            exporter.call("release", name, b, h.to_dict())
    row = {
        "bytes": n * block,
        "blocks": n,
        "pattern": pattern,
        "reps": reps,
        "check": check,
        "phases": phases,
        "timelines": timelines,
    }
    for k, ts in times.items():
        row[k] = {"gbps": n * block / statistics.median(ts) / 1e9, "ms": 1e3 * statistics.median(ts)}
    return row


def traced(
    exporter: Exporter, fetchers: Fetchers, name: str, handles: dict, into: list[int], reps: int = 3
) -> dict:
    """`--trace`: a few more fetches per backend with both processes' marks (splitserve/transport/trace.py)
    merged into one timeline each: [(ms since the fetch began, "F|E label")]."""
    out: dict[str, list] = {}
    for b in BACKENDS:
        trace.events(), exporter.call("trace")  # drop what came before
        out[b] = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fetchers.t[name, b].fetch(handles[b], into)
            t1 = time.perf_counter()
            time.sleep(0.005)  # the exporter's last marks (its "done") land
            marks = [(t, f"F {label}") for t, label in trace.events()]
            marks += [(t, f"E {label}") for t, label in exporter.call("trace")]
            marks += [(t0, "start"), (t1, "end")]
            out[b].append([(round(1e3 * (t - t0), 3), label) for t, label in sorted(marks)])
    return out


RUNS = {"KERNEL_MIN_RUNS": 1 << 30, "COPY_RUNS_MAX": 1 << 30}  # a cudaMemcpy per run, always
KERNEL = {"KERNEL_MIN_RUNS": 1}  # the block-copy kernel, always


def fetch_forced(transport, handle: KVHandle, into: list[int], knobs: dict[str, int]) -> None:
    saved = {k: getattr(gpu_blocks, k) for k in knobs}
    for k, v in knobs.items():
        setattr(gpu_blocks, k, v)
    try:
        transport.fetch(handle, into)
    finally:
        for k, v in saved.items():
            setattr(gpu_blocks, k, v)


# (TILE, STEPS, num_warps) of kernels/block_copy.py
KERNEL_CONFIGS = [(2048, 1, 8), (4096, 4, 8), (4096, 8, 16), (8192, 4, 16), (2048, 16, 4)]


def kernel_sweep(exporter: Exporter, fetchers: Fetchers, ladder_blocks: int, qwen_blocks: int,
                 gen: torch.Generator, reps: int = 10) -> list[dict]:  # fmt: skip
    """cuda_ipc's scattered fetch (the block-copy kernel) per kernel shape, beside the raw copy."""
    from splitserve.kernels import block_copy

    saved = (block_copy.TILE, block_copy.STEPS, block_copy.NUM_WARPS)
    out = []
    try:
        for name, n in (("ladder", ladder_blocks), ("qwen3-8b", qwen_blocks)):
            num_blocks = fetchers.caches[name][1]
            ids, into = block_ids("scattered", n, num_blocks, gen)
            handle = exporter.export(name, "cuda_ipc", ids)
            nbytes = n * layout_of(fetchers.caches[name][0]).block_nbytes
            fetcher = fetchers.t[name, "cuda_ipc"]
            runs: dict[str, Callable[[], object]] = {"raw_copy": lambda b=nbytes: fetchers.raw_copy(b)}
            for config in KERNEL_CONFIGS:

                def once(config=config, fetcher=fetcher, handle=handle, into=into) -> None:
                    block_copy.TILE, block_copy.STEPS, block_copy.NUM_WARPS = config
                    fetch_forced(fetcher, handle, into, KERNEL)

                runs["{}x{}/{}w".format(*config)] = once
            times = alternate(runs, reps)
            exporter.call("release", name, "cuda_ipc", handle.to_dict())
            out.append(sweep_row(f"kernel sweep {name} {fmt_size(nbytes)} scattered", times, nbytes,
                                 cache=name, bytes=nbytes))  # fmt: skip
    finally:
        block_copy.TILE, block_copy.STEPS, block_copy.NUM_WARPS = saved
    return out


def ce_sweep(exporter: Exporter, fetchers: Fetchers, ladder_blocks: int, qwen_blocks: int,
             gen: torch.Generator, reps: int = 10) -> list[dict]:  # fmt: skip
    """`--sweep-ce`: cuda_ipc's copy through the copy engines, by hand (cuMemcpyAsync via ctypes, about
    a microsecond a call): one copy per run of blocks spread round-robin over 1/2/4/8 streams (each
    stream may get a copy engine of its own), beside the raw copy and the block-copy kernel. For one
    run (contiguous) the run is cut into as many pieces as streams."""
    import ctypes

    lib = ctypes.CDLL("libcuda.so.1")
    lib.cuMemcpyAsync.argtypes = [ctypes.c_uint64, ctypes.c_uint64, ctypes.c_size_t, ctypes.c_void_p]
    lib.cuMemcpyAsync.restype = ctypes.c_int
    streams = [torch.cuda.Stream(device=FETCH) for _ in range(8)]
    out = []
    cases = [(name, n, pattern) for name, n in (("ladder", ladder_blocks), ("qwen3-8b", qwen_blocks))
             for pattern in ("contiguous", "scattered")]  # fmt: skip
    for name, n, pattern in cases:
        num_blocks = fetchers.caches[name][1]
        ids, into = block_ids(pattern, n, num_blocks, gen)
        handle = exporter.export(name, "cuda_ipc", ids)
        fetcher = fetchers.t[name, "cuda_ipc"]
        fetcher.fetch(handle, into)  # maps the exporter's KV
        (peer,) = list(fetcher.mover.link._peers.values())[-1:]
        block = layout_of(fetchers.caches[name][0]).block_nbytes
        src0, dst0 = peer.rows.data_ptr(), fetcher.mover.rows.data_ptr()
        if pattern == "contiguous":
            pieces = [(src0 + ids[0] * block, dst0 + into[0] * block, n * block)]
        else:
            pieces = [(src0 + s * block, dst0 + d * block, block) for s, d in zip(ids, into, strict=True)]
        nbytes = n * block

        def copy_on(k: int, pieces=pieces, nbytes=nbytes) -> None:
            work = pieces
            if len(pieces) == 1 and k > 1:  # cut the one run into k pieces
                s0, d0, total = pieces[0]
                step = -(-total // k)
                work = [(s0 + a, d0 + a, min(step, total - a)) for a in range(0, total, step)]
            current = torch.cuda.current_stream(FETCH)
            for st in streams[:k]:
                st.wait_stream(current)
            handles = [st.cuda_stream for st in streams[:k]]
            for i, (src, dst, size) in enumerate(work):
                err = lib.cuMemcpyAsync(dst, src, size, handles[i % k])
                if err:
                    raise RuntimeError(f"cuMemcpyAsync: CUresult {err}")
            for st in streams[:k]:
                current.wait_stream(st)
            torch.cuda.synchronize(FETCH)

        runs: dict[str, Callable[[], object]] = {"raw_copy": lambda b=nbytes: fetchers.raw_copy(b)}
        runs["fetch"] = lambda f=fetcher, h=handle, i=into: f.fetch(h, i)
        for k in (1, 2, 4, 8):
            runs[f"ce x{k}"] = lambda k=k, f=copy_on: f(k)
        times = alternate(runs, reps)
        fetcher.fetch(handle, into)
        exporter.call("release", name, "cuda_ipc", handle.to_dict())
        label = f"ce sweep {name} {fmt_size(nbytes)} {pattern} ({len(pieces)} copies)"
        out.append(sweep_row(label, times, nbytes, cache=name, pattern=pattern, bytes=nbytes,
                             pieces=len(pieces)))  # fmt: skip
    return out


# -- prefill at Qwen3-8B shape --------------------------------------------------------------------
def prefill_seconds(tokens: int, reps: int, device: str) -> dict:
    from splitserve.config.engine import EngineConfig
    from splitserve.engine.engine import LLMEngine
    from splitserve.model.random_weights import random_model, random_model_config
    from splitserve.sampling.params import SamplingParams

    t0 = time.perf_counter()
    loaded = random_model(random_model_config("qwen3-8b-random"), device, torch.bfloat16, tokens + 64)
    build_s = time.perf_counter() - t0
    blocks = 4 * (tokens // 16 + 4)
    config = EngineConfig(
        model="qwen3-8b-random", device=device, dtype="bfloat16",
        kv_cache_bytes=blocks * layout_of(QWEN3_8B).block_nbytes, max_model_len=tokens + 64,
        max_num_batched_tokens=tokens, enable_prefix_caching=False, progress=False,
    )  # fmt: skip
    engine = LLMEngine(config, tokenizer=False, loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    gen = torch.Generator().manual_seed(0)
    times = []
    for i in range(reps + 1):  # the first is a warm-up
        prompt = torch.randint(100, 150000, (tokens,), generator=gen).tolist()
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        engine.add_request(prompt, params, request_id=f"prefill-{i}")
        steps = 0
        while engine.has_unfinished_requests():
            engine.step()
            steps += 1
        torch.cuda.synchronize(device)
        if i:
            times.append(time.perf_counter() - start)
    return {"tokens": tokens, "seconds": statistics.median(times), "all": times, "steps": steps,
            "model_build_s": build_s}  # fmt: skip


# -- the run --------------------------------------------------------------------------------------
def size_ladder(max_mb: int) -> list[int]:
    sizes, mb = [], 1
    while mb <= max_mb:
        sizes.append(mb << 20)
        mb *= 4
    return sizes


def run(args: argparse.Namespace) -> dict:
    if torch.cuda.device_count() < 2 and FETCH != "cuda:0":
        raise SystemExit("needs two CUDA devices (--same-gpu: a smoke test on one)")
    ladder = {"block_size": args.block_size, "num_layers": args.layers, "num_kv_heads": args.kv_heads,
              "head_dim": args.head_dim}  # fmt: skip
    block = layout_of(ladder).block_nbytes
    sizes = size_ladder(args.max_mb)
    qwen_blocks = -(-args.prompt_tokens // 16)
    caches = {"ladder": (ladder, sizes[-1] // block + 8), "qwen3-8b": (QWEN3_8B, qwen_blocks + 64)}
    exporter = Exporter(caches)
    fetchers = Fetchers(caches, max(sizes[-1], qwen_blocks * layout_of(QWEN3_8B).block_nbytes))
    gen = torch.Generator().manual_seed(1)
    rows, qwen = [], []
    try:
        for nbytes in sizes:
            n = max(1, nbytes // block)
            reps = args.reps or max(5, min(30, (256 << 20) // nbytes))
            for pattern in ("contiguous", "scattered"):
                rows.append(measure(exporter, fetchers, "ladder", n, pattern, reps, gen))
                figs = ", ".join(f"{k} {rows[-1][k]['gbps']:.1f}" for k in (*BACKENDS, "raw_copy"))
                print(f"  {fmt_size(n * block)} {pattern}: {figs} GB/s", flush=True)
                print_timelines(rows[-1])
        latency = measure(exporter, fetchers, "ladder", 1, "contiguous", 50, gen)
        for pattern in ("contiguous", "scattered"):
            qwen.append(measure(exporter, fetchers, "qwen3-8b", qwen_blocks, pattern, args.reps or 20, gen))
            print_timelines(qwen[-1])
        sweep = ce = None
        if args.sweep_kernel:
            sweep = kernel_sweep(exporter, fetchers, sizes[-1] // block, qwen_blocks, gen)
        if args.sweep_ce:
            ce = ce_sweep(exporter, fetchers, sizes[-1] // block, qwen_blocks, gen)
        raw_sizes = sorted({r["bytes"] for r in rows + qwen if r["bytes"] >= 16 << 20})
        nccl_ceiling = {}
        if "nccl" in BACKENDS:
            nccl_ceiling = nccl_raw(exporter, fetchers.raw_dst, raw_sizes, args.reps or 10)
        described = exporter.call("describe")
        ours = {f"fetcher {n}/{b}": msgspec.to_builtins(t.describe()) for (n, b), t in fetchers.t.items()}
        described.update(ours)
    finally:
        fetchers.close()
        exporter.stop()
    del fetchers
    torch.cuda.empty_cache()
    prefill = None
    if not args.skip_prefill:
        try:
            prefill = prefill_seconds(args.prompt_tokens, 3, FETCH)
        except Exception as exc:  # noqa: BLE001 - report it, keep the transfer figures
            prefill = {"error": f"{type(exc).__name__}: {exc}"}
    return {
        "device": torch.cuda.get_device_name(0),
        "p2p": FETCH == "cuda:0" or torch.cuda.can_device_access_peer(1, 0),
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "torch": torch.__version__,
        "ladder_layout": ladder, "block_bytes": block, "rows": rows, "latency": latency,
        "qwen3_8b": {"prompt_tokens": args.prompt_tokens, "blocks": qwen_blocks, "rows": qwen},
        "prefill": prefill, "nccl_raw": nccl_ceiling, "describe": described,
        "kernel_sweep": sweep, "ce_sweep": ce,
    }  # fmt: skip


def report(result: dict) -> str:
    columns = [*BACKENDS, "cuda_ipc/runs", "cuda_ipc/kernel", "raw_copy"]
    head = (
        f"{result['device']} x2, p2p access {result['p2p']}, NCCL {result['nccl']}, torch {result['torch']}"
    )
    lines = [head,
             f"ladder blocks of {fmt_size(result['block_bytes'])}; GB/s (median) and % of raw copy",
             f"{'payload':>9} {'pattern':>10} | " + " ".join(f"{c:>13}" for c in columns)
             + " | " + " ".join(f"{c + ' %':>10}" for c in BACKENDS) + " | bytes ok"]  # fmt: skip
    for r in result["rows"]:
        figs = " ".join(f"{r[c]['gbps']:13.1f}" if c in r else f"{'-':>13}" for c in columns)
        ratios = " ".join(f"{r[b]['gbps'] / r['raw_copy']['gbps']:10.0%}" for b in BACKENDS)
        lines.append(f"{fmt_size(r['bytes']):>9} {r['pattern']:>10} | {figs} | {ratios} | {r['check'] or ''}")
    lat = result["latency"]
    lines.append(f"latency of a 1-block fetch ({fmt_size(lat['bytes'])}, median of 50): "
                 + ", ".join(f"{c} {lat[c]['ms']:.3f} ms" for c in (*BACKENDS, "raw_copy")))  # fmt: skip
    for b in BACKENDS:
        bulk = [r[b]["gbps"] / r["raw_copy"]["gbps"] for r in result["rows"] if r["bytes"] >= BULK_BYTES]
        if bulk:
            verdict = "PASS" if min(bulk) >= GOAL_RATIO else "FAIL"
            mid = statistics.median(bulk)
            lines.append(f"goal: {b} >= {GOAL_RATIO:.0%} of raw copy on payloads >= {fmt_size(BULK_BYTES)}:"
                         f" min {min(bulk):.0%}, median {mid:.0%} -> {verdict}")  # fmt: skip
    for probe, by_size in result.get("nccl_raw", {}).items():
        if "error" in by_size:
            lines.append(f"plain NCCL send/recv ({probe}): {by_size['error']}")
            continue
        figs = ", ".join(f"{fmt_size(n)} {v['gbps']:.1f}" for n, v in sorted(by_size.items()))
        lines.append(f"plain NCCL send/recv between the two processes ({probe}), GB/s: {figs}")
    q, prefill = result["qwen3_8b"], result["prefill"]
    lines.append(f"Qwen3-8B shape, {q['prompt_tokens']}-token prompt: {q['blocks']} blocks, "
                 f"{fmt_size(q['rows'][0]['bytes'])} of KV")  # fmt: skip
    have_prefill = prefill is not None and "seconds" in prefill
    if have_prefill:
        lines.append(f"  prefill on one GPU (engine, random weights): {1e3 * prefill['seconds']:.1f} ms "
                     f"(median of {len(prefill['all'])}, {prefill['steps']} step)")  # fmt: skip
    elif prefill is not None:
        lines.append(f"  prefill: not measured ({prefill['error']})")
    for r in q["rows"]:
        for c in (*BACKENDS, "raw_copy"):
            share = f", {r[c]['ms'] / 1e3 / prefill['seconds']:.2%} of prefill" if have_prefill else ""
            lines.append(f"  {r['pattern']:>10} {c:>9}: {r[c]['ms']:.2f} ms ({r[c]['gbps']:.1f} GB/s){share}")
        lines.append(f"  {'':>10} phases (ms, median): {r['phases']}")
    if have_prefill:
        worst = max(r[b]["ms"] for r in q["rows"] for b in BACKENDS) / 1e3 / prefill["seconds"]
        verdict = "PASS" if worst <= GOAL_PREFILL else "FAIL"
        lines.append(
            f"goal: prompt KV transfer <= {GOAL_PREFILL:.0%} of prefill: worst {worst:.2%} -> {verdict}"
        )
    return "\n".join(lines)


def print_timelines(row: dict) -> None:
    for backend, runs in (row.get("timelines") or {}).items():
        for marks in runs[-2:]:
            print(f"    {backend}: " + " | ".join(f"{ms:.3f} {label}" for ms, label in marks), flush=True)


def fmt_size(nbytes: int) -> str:
    if nbytes >= 2**30:
        return f"{nbytes / 2**30:g} GiB"
    if nbytes >= 2**20:
        return f"{nbytes / 2**20:g} MiB"
    return f"{nbytes / 2**10:g} KiB"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--max-mb", type=int, default=1024, help="largest ladder payload in MiB")
    p.add_argument("--reps", type=int, default=0, help="repetitions per size (default: by size)")
    p.add_argument("--layers", type=int, default=16)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--prompt-tokens", type=int, default=4096)
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument("--sweep-kernel", action="store_true", help="time cuda_ipc's block-copy kernel shapes")
    p.add_argument("--sweep-ce", action="store_true", help="time copies over the copy engines by hand")
    p.add_argument("--same-gpu", action="store_true", help="smoke test on one GPU: cuda_ipc, both on cuda:0")
    p.add_argument(
        "--trace", action="store_true", help="print timelines of a few fetches (transport/trace.py)"
    )
    p.add_argument("--json", help="where to write the results (default: $OUT or bench/results)")
    args = p.parse_args(argv)
    trace.ON = trace.ON or args.trace
    if args.same_gpu:
        global BACKENDS, FETCH
        BACKENDS, FETCH = ("cuda_ipc",), "cuda:0"
    result = run(args)
    print(report(result))
    default_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    path = Path(args.json) if args.json else default_dir / "kv_transfer_gpu.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=2, default=str))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
