"""Run a benchmark: for each target (a manifest to start, or a URL), warm up, then drive each swept
rate's trace (the same for every target), scraping /metrics and CPU/GPU use around each rate; stop
what was started.

The result of one target (`TargetRun.to_json`) is what the report and the verdict read:
    {name, source, kind, mode, model, hardware: {workers, devices, usd_per_hour, formula},
     points: [{rate, metrics, server, util, cost_per_accepted_usd}], error}
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import secrets
from collections import Counter
from dataclasses import dataclass, field, replace
from pathlib import Path

from tqdm.auto import tqdm

from splitserve.ab.client import ClientOptions, RequestResult, run_trace, served_model
from splitserve.ab.metrics import SLO, cost_per_accepted, summarize
from splitserve.ab.scrape import UtilSampler, delta, fetch_metrics, server_breakdown, workers
from splitserve.ab.workload import BenchRequest, at_rate
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
    client_procs: int | None = None  # load client processes (None: enough for the load)
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


class Session:
    """One target while it is benchmarked: open (start, verify, warm up), bench rates, close."""

    def __init__(self, target: Target, traces: list[list[BenchRequest]], opts: RunOptions) -> None:
        self.run, self.traces, self.opts = TargetRun(target), traces, opts
        self.sp = None
        self.url = target.source.rstrip("/")
        self.copts: ClientOptions | None = None

    def open(self) -> bool:
        t, run = self.run.target, self.run
        try:
            if t.manifest is not None:
                from splitserve.runtime.process import start_serve

                run.mode = t.manifest.mode
                _say(self.opts, f"starting {t.name} ({t.source}, {run.mode}) ...")
                manifest = t.manifest.model_copy(deep=True)
                manifest.server.port = 0
                # the deployment's secret, known here too: the verify gate talks to its workers
                os.environ.setdefault(manifest.transport.secret_env, secrets.token_hex(32))
                self.sp = start_serve(manifest)
                self.url, run.model = self.sp.url, self.sp.ready.get("model", "")
                run.hardware = manifest_hardware(manifest, self.opts.prices)
            self.copts = asyncio.run(_prepare(run, self.url, self.opts))
        except Exception as exc:  # noqa: BLE001 - a target that fails is reported, the others still run
            self._fail(exc)
        return run.error is None

    def bench(self, i: int) -> None:
        """The i-th swept rate, with its trace."""
        if self.run.error is not None or self.copts is None:
            return
        pid = self.sp.proc.pid if self.sp else None
        rate, trace = self.opts.rates[i], self.traces[i]
        try:
            point = asyncio.run(_bench_rate(self.run, self.url, trace, rate, self.copts, self.opts, pid))
            self.run.points.append(point)
        except Exception as exc:  # noqa: BLE001
            self._fail(exc)

    def close(self) -> None:
        if self.sp is not None:
            self.sp.stop()
            self.sp = None

    def _fail(self, exc: Exception) -> None:
        self.run.error = f"{type(exc).__name__}: {exc}"
        if self.sp is not None:
            self.run.error += "\n" + "\n".join(list(self.sp.log)[-20:])


def run_targets(
    targets: list[Target], traces: list[list[BenchRequest]], opts: RunOptions, interleave: bool = False
) -> list[TargetRun]:
    """Each target in turn (started, every rate, stopped); or, interleaved, all started at once and each
    rate run on every target back to back (order alternating by rate), so that a machine whose load
    drifts treats the sides alike. traces[i] is the trace of opts.rates[i]. Errors end up in each
    TargetRun.error."""
    sessions = [Session(t, traces, opts) for t in targets]
    try:
        if interleave:
            for s in sessions:
                s.open()
            for i in range(len(opts.rates)):
                for s in sessions if i % 2 == 0 else sessions[::-1]:
                    s.bench(i)
        else:
            for s in sessions:
                if s.open():
                    for i in range(len(opts.rates)):
                        s.bench(i)
                s.close()
    finally:
        for s in sessions:
            s.close()
    return [s.run for s in sessions]


def run_target(target: Target, traces: list[list[BenchRequest]], opts: RunOptions) -> TargetRun:
    """Start (if a manifest), bench every rate, stop."""
    return run_targets([target], traces, opts)[0]


async def _prepare(run: TargetRun, url: str, opts: RunOptions) -> ClientOptions:
    """The gate (if asked), the model name, warm-up requests, and a URL target's hardware."""
    if opts.verify:
        await _gate(run, url, opts)
    run.model = opts.model or run.model or await served_model(url, opts.api_key)
    copts = ClientOptions(
        run.model,
        api_key=opts.api_key,
        temperature=opts.temperature,
        ignore_eos=opts.ignore_eos,
        timeout_s=opts.timeout_s,
        max_concurrency=opts.max_concurrency,
        procs=opts.client_procs,
    )
    if opts.warmup:
        await _warm_up(url, copts, opts.warmup)
    if not run.hardware:  # a URL target: its workers from /metrics
        run.hardware = url_hardware(await fetch_metrics(url, opts.api_key), opts.url_device, opts.prices)
        roles = {w["role"] for w in run.hardware["workers"]}
        run.mode = "disaggregated" if "prefill" in roles else "colocated" if "colocated" in roles else None
    return copts


async def _gate(run: TargetRun, url: str, opts: RunOptions) -> None:
    """`splitserve verify` on the running deployment; a target that fails it is not benchmarked."""
    from splitserve.gate.verify import verify_url

    _say(opts, f"verifying {run.target.name} ...")
    env = run.target.manifest.transport.secret_env if run.target.manifest else "SPLITSERVE_KV_SECRET"
    if run.target.manifest is None and not os.environ.get(env):  # a URL: its workers want the KV secret
        raise RuntimeError(
            f"the verify gate reaches the deployment's workers with its KV secret, and ${env} is not set: "
            f"start `splitserve serve` with {env}=<secret> in its environment and export the same here "
            "(unset, a local `splitserve serve` makes a secret of its own that no other process knows), "
            "or pass --skip-verify to benchmark without the gate"
        )
    report = await verify_url(url, opts.api_key, os.environ.get(env))
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
    stats: dict = {}
    results, duration = await run_trace(url, reqs, copts, done, stats=stats)
    usage = util.stop(stats.get("child_cpu_s", 0.0)) | {"client_procs": stats.get("procs", 1)}
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
    results, _ = await run_trace(url, warm, replace(copts, procs=1))
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


__all__ = [
    "RunOptions",
    "Session",
    "Target",
    "TargetRun",
    "manifest_hardware",
    "run_target",
    "run_targets",
    "url_hardware",
]
