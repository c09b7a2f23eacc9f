"""The load client: drive a trace at one OpenAI-compatible endpoint, streaming, and time every chunk.

`run_trace` is the entry point: on this event loop (`splitserve.ab.drive`, which says what is timed and
how) or, with `ClientOptions.procs` > 1, spread over processes (splitserve.ab.procs), each driving its
share on its own event loop against one shared start time. Both import from `drive`, none from here.
"""

from __future__ import annotations

from collections.abc import Callable

import httpx

from splitserve.ab.drive import (
    _PARSE,
    ClientOptions,
    RequestResult,
    _parse,
    _quick,
    chains,
    drive,
    send_one,
)
from splitserve.ab.procs import client_procs, run_procs
from splitserve.ab.workload import BenchRequest


async def run_trace(
    base_url: str,
    trace: list[BenchRequest],
    opts: ClientOptions,
    on_done: Callable[[RequestResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    stats: dict | None = None,
) -> tuple[list[RequestResult], float]:
    """Send `trace` (arrival offsets set) and wait for every answer. Returns the results in trace
    order and the run's duration: first send scheduled to last answer, as vLLM's benchmark_duration.
    With `opts.procs` > 1 (None: as many as the load needs) the trace is spread over client processes
    (splitserve.ab.procs); a `transport` (a mock) works in this process only. `stats`, if given,
    gets `procs` (how many ran) and `child_cpu_s` (their CPU seconds: this process's are not in it)."""
    n = 1 if transport is not None and opts.procs is None else client_procs(trace, opts)
    if stats is not None:
        stats.update(procs=n, child_cpu_s=0.0)
    if n == 1:
        return await drive(base_url, trace, opts, on_done, transport)
    if transport is not None:
        raise ValueError("a transport works in one client process only (procs=1)")
    return await run_procs(base_url, trace, opts, n, on_done, stats)


async def served_model(base_url: str, api_key: str | None = None) -> str:
    """The first model id that GET /v1/models lists."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with httpx.AsyncClient(base_url=base_url, headers=headers, timeout=30.0) as client:
        resp = await client.get("/v1/models")
        resp.raise_for_status()
        return resp.json()["data"][0]["id"]


__all__ = [
    "_PARSE",
    "ClientOptions",
    "RequestResult",
    "_parse",
    "_quick",
    "chains",
    "drive",
    "run_trace",
    "send_one",
    "served_model",
]
