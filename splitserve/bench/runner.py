"""Run a benchmark: for each target (a manifest to start, or a URL), warm up, then drive the same trace
at every swept rate, scraping /metrics and CPU/GPU use around each rate; stop what was started.

The result of one target (`TargetRun.to_json`) is what the report and the verdict read:
    {name, source, kind, mode, model, hardware: {workers, devices, usd_per_hour, formula},
     points: [{rate, metrics, server, util, cost_per_accepted_usd}], error}
"""

from __future__ import annotations

import asyncio
import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tqdm.auto import tqdm

from splitserve.bench.client import ClientOptions, RequestResult, run_trace, served_model
from splitserve.bench.metrics import SLO, cost_per_accepted, summarize
from splitserve.bench.scrape import UtilSampler, delta, fetch_metrics, server_breakdown, workers
from splitserve.bench.workload import BenchRequest, at_rate
from splitserve.config.manifest import Manifest


@dataclass
class Target:
    name: str
    source: str  # a manifest path or an http(s) URL
    manifest: Manifest | None = None

    @property
    def is_url(self) -> bool:
        return self.manifest is None


@dataclass
class RunOptions:
    rates: list[float | None]
    slo: SLO
    prices: dict[str, float]  # USD per device-hour by kind
    burstiness: float = 1.0
    seed: int = 0
    warmup: int = 2
    url_device: str = "cpu"  # what a URL target's workers run on (for cost)
    api_key: str | None = None
    model: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    max_concurrency: int | None = None
    progress: bool = True
    out_dir: Path | None = None  # per-request records go here
    verify: bool = False  # run the `splitserve verify` gate on each target first (fail closed)


@dataclass
class TargetRun:
    target: Target
    mode: str | None = None
    model: str = ""
    hardware: dict = field(default_factory=dict)
    points: list[dict] = field(default_factory=list)
    error: str | None = None
    gate: dict = field(default_factory=lambda: {"status": "gate not run"})

    def to_json(self) -> dict:
        return {
            "name": self.target.name,
            "source": self.target.source,
            "kind": "url" if self.target.is_url else "manifest",
            "mode": self.mode,
            "model": self.model,
            "hardware": self.hardware,
            "points": self.points,
            "error": self.error,
            "gate": self.gate,
        }


def manifest_hardware(manifest: Manifest, prices: dict[str, float]) -> dict:
    """One device per worker replica: its kind from the pool's `devices` or `model.device`."""
    default = manifest.model.device
    if default == "auto":
        default = "cuda" if _cuda() else "cpu"
    found = []
    for role, pool in manifest.pools().items():
        for i in range(pool.replicas):
            dev = pool.devices[i] if i < len(pool.devices) else default
            found.append({"role": role, "device": dev.split(":")[0]})
    return _priced(found, prices)


def url_hardware(samples: dict | None, device: str, prices: dict[str, float]) -> dict:
    """A URL target's workers from its /metrics (one if it publishes none), all on `device`."""
    found = [{"role": w["role"], "device": device} for w in workers(samples)] or [
        {"role": "?", "device": device}
    ]
    return _priced(found, prices)


def _priced(found: list[dict], prices: dict[str, float]) -> dict:
    devices = dict(Counter(w["device"] for w in found))
    missing = sorted(k for k in devices if k not in prices)
    if missing:
        raise ValueError(f"no price for device kind {', '.join(missing)}: add it to prices.usd_per_hour")
    usd = sum(prices[k] * n for k, n in devices.items())
    formula = " + ".join(f"{n} x {k} at ${prices[k]:g}/h" for k, n in sorted(devices.items()))
    return {"workers": found, "devices": devices, "usd_per_hour": usd, "formula": f"{formula} = ${usd:g}/h"}


def _cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def run_target(target: Target, trace: list[BenchRequest], opts: RunOptions) -> TargetRun:
    """Start (if a manifest), bench every rate, stop. Errors end up in TargetRun.error."""
    run = TargetRun(target)
    sp = None
    try:
        if target.manifest is not None:
            from splitserve.runtime.process import start_serve

            run.mode = target.manifest.mode
            _say(opts, f"starting {target.name} ({target.source}, {run.mode}) ...")
            manifest = target.manifest.model_copy(deep=True)
            manifest.server.port = 0
            sp = start_serve(manifest)
            url, run.model = sp.url, sp.ready.get("model", "")
            run.hardware = manifest_hardware(manifest, opts.prices)
        else:
            url = target.source.rstrip("/")
        asyncio.run(_bench(run, url, trace, opts, sp.proc.pid if sp else None))
    except Exception as exc:  # noqa: BLE001 - a target that fails is reported, the others still run
        run.error = f"{type(exc).__name__}: {exc}"
        if sp is not None:
            run.error += "\n" + "\n".join(list(sp.log)[-20:])
    finally:
        if sp is not None:
            sp.stop()
    return run


async def _bench(
    run: TargetRun, url: str, trace: list[BenchRequest], opts: RunOptions, pid: int | None
) -> None:
    if opts.verify:
        await _gate(run, url, opts)
    model = opts.model or run.model or await served_model(url, opts.api_key)
    run.model = model
    copts = ClientOptions(
        model,
        api_key=opts.api_key,
        temperature=opts.temperature,
        ignore_eos=opts.ignore_eos,
        timeout_s=opts.timeout_s,
        max_concurrency=opts.max_concurrency,
    )
    if opts.warmup:
        await _warm_up(url, copts, opts.warmup)
    if not run.hardware:  # a URL target: its workers from /metrics
        run.hardware = url_hardware(await fetch_metrics(url, opts.api_key), opts.url_device, opts.prices)
        roles = {w["role"] for w in run.hardware["workers"]}
        run.mode = "disaggregated" if "prefill" in roles else "colocated" if "colocated" in roles else None
    for rate in opts.rates:
        run.points.append(await _bench_rate(run, url, trace, rate, copts, opts, pid))


async def _gate(run: TargetRun, url: str, opts: RunOptions) -> None:
    """`splitserve verify` on the running deployment; a target that fails it is not benchmarked."""
    from splitserve.gate.verify import verify_url

    _say(opts, f"verifying {run.target.name} ...")
    report = await verify_url(url, opts.api_key)
    failed = [f"{c.name} ({c.scope}): {c.detail}" for c in report.checks if not c.ok]
    run.gate = {"status": "passed" if report.ok else "failed", "report": report.to_dict()}
    if not report.ok:
        raise RuntimeError("the verify gate failed: " + "; ".join(filter(None, [report.error, *failed])))


async def _bench_rate(
    run: TargetRun,
    url: str,
    trace: list[BenchRequest],
    rate: float | None,
    copts: ClientOptions,
    opts: RunOptions,
    pid: int | None,
) -> dict:
    reqs = at_rate(trace, rate, opts.burstiness, opts.seed)
    label = "as recorded" if rate is None else f"{rate:g} req/s"
    bar = tqdm(total=len(reqs), desc=f"{run.target.name} @ {label}", unit="req", disable=not opts.progress)
    failed = 0

    def done(r: RequestResult) -> None:
        nonlocal failed
        failed += not r.success
        bar.update(1)
        if failed:
            bar.set_postfix(failed=failed)

    before = await fetch_metrics(url, opts.api_key)
    util = UtilSampler(pid).start()
    results, duration = await run_trace(url, reqs, copts, done)
    usage = util.stop()
    after = await fetch_metrics(url, opts.api_key)
    bar.close()
    metrics = summarize(results, duration, opts.slo)
    usd = run.hardware["usd_per_hour"]
    if opts.out_dir is not None:
        _save_requests(opts.out_dir, run.target.name, label, results)
    return {
        "rate": rate,
        "offered_rate": _offered(reqs),
        "metrics": metrics,
        "server": server_breakdown(delta(before, after)) if after else {},
        "util": usage,
        "cost_per_accepted_usd": cost_per_accepted(usd, duration, metrics["good"]),
        "cost_usd": usd * duration / 3600.0,
    }


def _offered(reqs: list[BenchRequest]) -> float:
    """Requests over the span of first-turn arrivals (the rate the trace actually offers)."""
    firsts = [r.arrival_s for r in reqs if r.turn == 0]
    span = max(firsts) if firsts else 0.0
    return len(reqs) / span if span > 0 else math.inf


async def _warm_up(url: str, copts: ClientOptions, n: int) -> None:
    """A few short requests, not measured (the first request pays for lazy set-up)."""
    warm = [BenchRequest(i, tuple(range(1000, 1016)), 16, 4) for i in range(n)]
    results, _ = await run_trace(url, warm, copts)
    bad = [r for r in results if not r.success]
    if len(bad) == len(results):
        raise RuntimeError(f"the endpoint answered no warm-up request: {bad[0].error_kind} {bad[0].error}")


def _save_requests(out: Path, name: str, label: str, results: list[RequestResult]) -> None:
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in f"{name}-{label}")
    path = out / "requests" / f"{safe}.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for r in results:
            f.write(json.dumps(r.to_json()) + "\n")


def _say(opts: RunOptions, msg: str) -> None:
    if opts.progress:
        tqdm.write(msg)


__all__ = ["RunOptions", "Target", "TargetRun", "manifest_hardware", "run_target", "url_hardware"]
