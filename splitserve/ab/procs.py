"""The load client over several processes, so that the client is not what limits a fast server.

One Python process that streams thousands of tokens/s spends a core on HTTP and SSE work, and then reads
every chunk late: it under-reports the throughput and adds to TTFT/ITL. `run_procs` deals the trace's
chains (an independent request alone; an agent session's turns together, so a session never spans two
processes) round-robin, in order of first arrival, to N processes (forked by a forkserver that has
imported this module, else spawned; plain picklable records and options go each way), each driving its
share with `drive.drive` on its own event loop (uvloop where it is installed) and its own connection
pool. Before the run each process sends one request to a stub of its own (`_warm`), so that no measured
request pays for first-use costs; the target server's warm-up stays the runner's.

Timing is the same as in one process. Every process starts at one shared moment: once all of them have
started and set up their HTTP clients, the parent picks a time a little ahead on time.time() (the clock
every process shares) and each converts it into its own perf_counter() reading. Arrival offsets (Poisson
or gamma gaps) count from that start in every process, so the trace's arrival pattern holds across them,
and every record's `start_s` is on that common clock. TTFT, ITL and e2e are perf_counter differences
within a process, as before. The run's duration is from the shared start to the last process's last
answer. Records are the same `RequestResult`s (pickled back as each request finishes, so progress shows
live), returned in trace order. `--max-concurrency` is split among the processes (each a semaphore of
its share, the shares summing to the limit; never more processes than the limit), which differs from one
global queue only in which waiting request goes next.
"""

from __future__ import annotations

import asyncio
import importlib
import math
import multiprocessing as mp
import os
import queue
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import replace

import httpx

from splitserve.ab.drive import ClientOptions, RequestResult, chains, drive, send_one
from splitserve.ab.workload import BenchRequest
from splitserve.web.loop import loop_factory

# What httpx imports on a process's first request (~15 ms that would land on each process's first TTFT):
# imported here, so by the forkserver once (each client process a fork of it) or by a spawned one before
# it says it is ready.
for _mod in ("anyio._backends._asyncio", "anyio.streams.tls", "anyio.to_thread", "httpcore._backends.anyio"):
    try:
        importlib.import_module(_mod)
    except ImportError:  # another httpx/anyio layout: only the first request pays
        pass

PER_PROC = 64  # concurrent streams one client process is given when the count is chosen for the load
LEAD_S = 0.05  # from "all ready" to the shared start
_POLL_S = 0.5


def client_procs(trace: list[BenchRequest], opts: ClientOptions) -> int:
    """How many processes run `trace`: opts.procs, or (None) one per PER_PROC of the most requests that
    can be in flight (max_concurrency, else every chain at once), at most one per usable core; never more
    than there are chains or than max_concurrency."""
    n_chains = len(chains(trace))
    load = min(opts.max_concurrency or n_chains, n_chains)
    if opts.procs is None:
        n = min(_cores(), math.ceil(load / PER_PROC))
    elif opts.procs < 1:
        raise ValueError(f"client procs must be at least 1, got {opts.procs}")
    else:
        n = opts.procs
    return max(1, min(n, load))


def split(trace: list[BenchRequest], n: int) -> list[list[BenchRequest]]:
    """The chains dealt round-robin in order of first arrival: each share sees the whole run's rate
    pattern, thinned n-fold."""
    ordered = sorted(chains(trace), key=lambda c: c[0].arrival_s)
    shares: list[list[BenchRequest]] = [[] for _ in range(n)]
    for i, c in enumerate(ordered):
        shares[i % n].extend(c)
    return shares


def concurrency_shares(limit: int | None, n: int) -> list[int | None]:
    """`limit` split as evenly as can be over n processes (None: no limit)."""
    if not limit:
        return [None] * n
    return [limit // n + (k < limit % n) for k in range(n)]


async def run_procs(
    base_url: str,
    trace: list[BenchRequest],
    opts: ClientOptions,
    n: int,
    on_done: Callable[[RequestResult], None] | None = None,
    stats: dict | None = None,
) -> tuple[list[RequestResult], float]:
    """`trace` over n client processes (see the module docstring); as client.run_trace. `on_done` runs
    on this event loop. `stats["child_cpu_s"]`: the processes' CPU seconds, start-up included."""
    loop = asyncio.get_running_loop()
    cb = None if on_done is None else (lambda r: loop.call_soon_threadsafe(on_done, r))
    stop = threading.Event()
    try:
        results, duration, cpu = await asyncio.to_thread(_run, base_url, trace, opts, n, cb, stop)
    finally:
        stop.set()  # cancelled: the thread stops its processes at its next poll
    if stats is not None:
        stats["child_cpu_s"] = cpu
    return results, duration


def _run(
    base_url: str,
    trace: list[BenchRequest],
    opts: ClientOptions,
    n: int,
    on_done: Callable[[RequestResult], None] | None,
    stop: threading.Event,
) -> tuple[list[RequestResult], float, float]:
    ctx = _context()
    out = ctx.Queue()
    go = ctx.Event()
    start_wall = ctx.Value("d", 0.0, lock=False)
    concs = concurrency_shares(opts.max_concurrency, n)
    procs = [
        ctx.Process(
            target=_child,
            args=(k, base_url, share, replace(opts, max_concurrency=concs[k], procs=1), go, start_wall, out),
            name=f"splitserve-bench-client-{k}",
            daemon=True,
        )
        for k, share in enumerate(split(trace, n))
    ]
    results: dict[int, RequestResult] = {}
    ends: dict[int, tuple[float, float]] = {}
    try:
        for p in procs:
            p.start()
        ready = 0
        while ready < n:
            kind, _, payload = _next(out, procs, ends, stop)
            ready += kind == "ready"
        start_wall.value = time.time() + LEAD_S
        go.set()
        while len(ends) < n:
            kind, k, payload = _next(out, procs, ends, stop)
            if kind == "done":
                results[payload.index] = payload
                if on_done is not None:
                    on_done(payload)
            elif kind == "end":
                ends[k] = payload
        for p in procs:
            p.join(10)
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            if p.pid is not None:
                p.join(5)
        out.close()
    duration = max(d for d, _ in ends.values())
    return [results[r.index] for r in trace], duration, sum(c for _, c in ends.values())


def _next(out, procs: list, ends: dict, stop: threading.Event) -> tuple[str, int, object]:
    """The next message from the processes; raises if one failed, died, or the run was stopped."""
    while True:
        try:
            msg = out.get(timeout=_POLL_S)
        except queue.Empty:
            if stop.is_set():
                raise RuntimeError("the client processes were stopped") from None
            dead = [k for k, p in enumerate(procs) if k not in ends and not p.is_alive()]
            if not dead:
                continue
            try:  # its last messages may still be on their way
                msg = out.get(timeout=2 * _POLL_S)
            except queue.Empty:
                k = dead[0]
                raise RuntimeError(
                    f"client process {k} ended (exit code {procs[k].exitcode}) without its results"
                ) from None
        if msg[0] == "error":
            raise RuntimeError(f"client process {msg[1]} failed:\n{msg[2]}")
        return msg


def _child(
    k: int,
    base_url: str,
    share: list[BenchRequest],
    opts: ClientOptions,
    go,
    start_wall,
    out,
) -> None:
    """One client process: its share of the trace from the shared start; every record sent back as it
    finishes, then (its duration from the shared start, its CPU seconds)."""
    try:

        def start_at() -> float:
            out.put(("ready", k, None))
            parent = mp.parent_process()
            while not go.wait(1.0):  # nothing else runs on this loop yet: blocking is harmless
                if parent is not None and not parent.is_alive():
                    raise RuntimeError("the parent went away")
            return time.perf_counter() + (start_wall.value - time.time())

        def done(r: RequestResult) -> None:
            out.put(("done", k, r))

        with asyncio.Runner(loop_factory=loop_factory()) as runner:
            runner.run(_warm())
            _, duration = runner.run(drive(base_url, share, opts, done, start_at=start_at))
        out.put(("end", k, (duration, time.process_time())))
    except BaseException:  # noqa: BLE001 - reported to the parent, which fails the run
        out.put(("error", k, traceback.format_exc()))


async def _warm() -> None:
    """One request through the client's code (httpx, h11, anyio's connect, the SSE reader) to a stub of
    this process's own, before it says it is ready: its first measured request then pays no first-use
    costs (a few ms of TTFT), and the target server sees nothing of it."""
    events = b'data: {"choices":[{"text":"x"}]}\n\ndata: {"choices":[],"usage":{"completion_tokens":1}}\n\n'
    events += b"data: [DONE]\n\n"

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(x[15:]) for x in head.lower().split(b"\r\n") if x.startswith(b"content-length:"))
        await reader.readexactly(length)
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
        )
        writer.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(events), events))
        await writer.drain()
        writer.close()

    try:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        async with httpx.AsyncClient(base_url=url, timeout=10.0) as client:
            await send_one(client, BenchRequest(0, (1,), 1, 1), ClientOptions("warm-up"), time.perf_counter())
        server.close()
    except Exception:  # noqa: BLE001 - best effort: without it only the first request pays
        pass


def _context() -> mp.context.BaseContext:
    """forkserver where there is one (a process that has imported this module once, so that each client
    process is a cheap fork of it: `import splitserve` loads torch), else spawn."""
    try:
        ctx = mp.get_context("forkserver")
    except ValueError:
        return mp.get_context("spawn")
    ctx.set_forkserver_preload([__name__])  # effective when the server starts (the first run)
    return ctx


def _cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return os.cpu_count() or 1


__all__ = ["LEAD_S", "PER_PROC", "client_procs", "concurrency_shares", "run_procs", "split"]
