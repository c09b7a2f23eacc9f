"""The served path against the engine alone: a profile's `request_s`, `served_factor` and
`served_decode_factor` (`StepCost`'s).

A request through `splitserve serve` takes longer than the engine's steps for it: the load client,
the router and the worker's front end (HTTP, streaming, detokenization) share the host's CPUs with
the engine cores, and a worker's engine runs under its front end. `measure_served` starts the
manifest's model colocated, one pinned replica per share of this host's CPUs (the profile's), sends
prompts of 128-448 random token ids one at a time (`ROUNDS` times each) through the same load client
`splitserve bench` uses, and takes two figures from them:

    request_s       the fixed part of a request's way: the client's time to first token less the
                    router's own timing of the worker's queue and prefill (the load client, the router,
                    HTTP and streaming); the median over the requests. The simulator adds it to
                    every token's delivery, so TTFT carries it once.
    served_factor   the median of (time to first token - request_s) over the profile's prefill
                    step; the simulator stretches every step with prompt tokens by it
    served_decode_factor  the median of each request's median time between tokens over the
                    profile's decode step; the simulator stretches every decode-only step by it
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Callable

import yaml

from splitserve.config.manifest import Manifest, parse_manifest
from splitserve.plan.cost import StepCost

PROMPT_LENS = (128, 192, 256, 320, 384, 448)
OUTPUT_LEN = 24
ROUNDS = 2  # each prompt length this many times (fresh prompts: no prefix-cache hits)
GAP_S = 2.0  # between sends: each request runs alone (longest: ~1 s prefill + 24 steps of ~35 ms)


def served_manifest(manifest: Manifest, workers: int) -> Manifest:
    """`manifest`'s model and engine, colocated on `workers` pinned replicas, no spare, port 0."""
    overrides = {"mode": "colocated", "colocated.replicas": workers, "runtime.pin_cores": True,
                 "runtime.standby": False, "server.port": 0, "router.policy": "least_loaded"}  # fmt: skip
    return parse_manifest(yaml.safe_dump(manifest.model_dump(mode="json")), "served probe", overrides)


def request_cost(results: list) -> float:
    """The median of time to first token less the router's queue and prefill timings (its
    x-splitserve-ttft-* headers), in seconds, over the successful `results`; 0 where none has them."""
    outside = [
        r.ttft_s - (r.server_ms["queue"] + r.server_ms["prefill"]) / 1e3
        for r in results
        if r.success and "prefill" in r.server_ms and "queue" in r.server_ms
    ]
    return max(0.0, statistics.median(outside)) if outside else 0.0


def served_factors(results: list, cost: StepCost, request_s: float = 0.0) -> tuple[float, float]:
    """-> (the median of (TTFT - `request_s`) / predicted prefill, the median of median ITL / predicted
    decode step) over `results` (the load client's RequestResults of lone requests)."""
    prefill, decode = [], []
    for r in results:
        if not r.success or not r.itl_s:
            continue
        prefill.append((r.ttft_s - request_s) / cost.prefill_s(r.prompt_len))
        decode.append(statistics.median(r.itl_s) / cost.decode_s(1, r.prompt_len + len(r.itl_s) // 2))
    if not prefill:
        raise RuntimeError("the served probe got no answer")
    return statistics.median(prefill), statistics.median(decode)


def measure_served(
    manifest: Manifest, cost: StepCost, workers: int, log: Callable = print
) -> tuple[float, float, float]:
    """-> (served_factor, served_decode_factor, request_s) of `manifest`'s model served on `workers`
    pinned replicas."""
    from splitserve.ab.client import run_trace
    from splitserve.ab.drive import ClientOptions
    from splitserve.ab.workload import BenchRequest
    from splitserve.plan.corun import random_prompts
    from splitserve.runtime.process import start_serve

    served = served_manifest(manifest, workers)
    lens = [n for _ in range(ROUNDS) for n in PROMPT_LENS]
    trace = [
        BenchRequest(i, tuple(random_prompts(1, n, 1000, 40 + i)[0]), n, OUTPUT_LEN, arrival_s=i * GAP_S)
        for i, n in enumerate(lens)
    ]
    sp = start_serve(served, timeout_s=300)
    try:
        keys = served.server.keys()
        opts = ClientOptions(served.model.resolved_served_name(), api_key=keys[0] if keys else None)
        results, _ = asyncio.run(run_trace(sp.url, trace, opts))
    finally:
        sp.stop()
    request_s = request_cost(results)
    prefill, decode = served_factors(results, cost, request_s)
    log(
        f"  served: {len(results)} lone requests through the server: prompt steps x{prefill:.3f} the "
        f"engine's, decode steps x{decode:.3f}, + {request_s * 1e3:.1f} ms a request outside them"
    )
    return prefill, decode, request_s


__all__ = ["measure_served", "request_cost", "served_factors", "served_manifest"]
