"""`splitserve serve`: start a manifest's workers (local runtime), then the OpenAI API in front of them.

Order of events: the tokenizer loads in this process -> the port is bound and answers at once, every
request a 503 "starting" with Retry-After (runtime/start_gate.py) -> workers spawn and load weights (a
progress bar over workers; each worker's log lines are prefixed with its name) -> a warm-up request ->
the API takes the port over and prints `splitserve: serving MODEL at URL` (tests read it) and where
the start's time went per process (runtime/startup_report.py) -> the warm spare starts -> requests.
SIGTERM or SIGINT: the API stops accepting, in-flight requests get `runtime.drain_timeout_s` to finish,
then the workers are stopped (SIGTERM, then SIGKILL). A second signal skips the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Callable, Generator

import msgspec
import uvicorn

from splitserve.config.manifest import Manifest
from splitserve.heap import freeze_heap
from splitserve.model.generation_defaults import describe as describe_defaults
from splitserve.model.generation_defaults import generation_defaults
from splitserve.model.tokenizer import Tokenizer, load_tokenizer
from splitserve.router.chat_template import use_chat_template
from splitserve.router.probe import KVProber
from splitserve.router.routes import build_api
from splitserve.router.server import ModelInfo, OpenAIServer
from splitserve.router.stats_log import StatsLogger
from splitserve.router.warmup import warm_up
from splitserve.runtime import startup_report
from splitserve.runtime.local import LocalRuntime
from splitserve.runtime.role_switch import RoleSwitcher
from splitserve.runtime.start_gate import StartGate
from splitserve.runtime.startup_report import phases
from splitserve.runtime.zygote import Zygote
from splitserve.startup_clock import mark, marks, process_age_s
from splitserve.web.edge_guard import ReadLimits, guarded_protocol
from splitserve.web.listen import KEEP_ALIVE_S, listen
from splitserve.wire.stats import WorkerRow, WorkerStats

log = logging.getLogger(__name__)

SPARE_DELAY_S = 5.0  # after ready, before the warm spare worker starts


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:  # we install our own (run_manifest)
        yield


async def _worker_stats(runtime: LocalRuntime, timeout_s: float = 2.0) -> list[WorkerRow]:
    async def one(w) -> WorkerRow:  # noqa: ANN001
        row = WorkerRow(w.name, w.role, w.ready)
        if w.ready:
            with contextlib.suppress(Exception):
                r = await runtime._http.get(f"{w.url}/stats", timeout=timeout_s)
                row.stats = msgspec.json.decode(r.content, type=WorkerStats)
        return row

    return list(await asyncio.gather(*(one(w) for w in runtime.workers)))


async def run_manifest(manifest: Manifest, progress: bool = True, zygote: Zygote | None = None) -> int:
    """Serve `manifest` until a signal; `zygote`: the engine-core fork server, when begun already."""
    if manifest.runtime.kind != "local":
        raise ValueError(
            f"runtime.kind {manifest.runtime.kind!r} is not available from `splitserve serve` yet"
        )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0
    api: OpenAIServer | None = None

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1 and api is not None:  # a second before uvicorn's own drain timeout ends
            cut_at = max(0.0, manifest.runtime.drain_timeout_s - 1.0)
            loop.call_later(cut_at, lambda: api is not None and api.cut_streams())
        stop.set()
        server.should_exit = True
        server.force_exit = signals > 1
        log.warning("signal received: %s", "draining" if signals == 1 else "stopping now")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    mark("imports")  # start-up phases, in the ready line (runtime/startup_report.py)
    # the tokenizer before the port: parsing it holds the interpreter for ~0.1 s, which would hold up
    # the 503s below (the converted tokenizer is cached by setup's `prepare`, or by a worker)
    tokenizer = load_tokenizer(manifest.model.source, manifest.model.tokenizer)
    use_chat_template(tokenizer, manifest.model.chat_template)  # vLLM's --chat-template
    mark("tokenizer")

    # the collector's pass over the imports (~50 ms) now, not once the port answers (the 503s would wait)
    freeze_heap("router imports")

    def on_event(kind: str, worker: object) -> None:
        if api is not None:
            api.on_worker_event(kind, worker)

    runtime = LocalRuntime(manifest, on_event, zygote)  # before the port: its HTTP client takes ~50 ms
    # bind (a busy port fails fast), and answer on it at once: 503 "starting" until ready
    sock, url = listen(manifest.server.host, manifest.server.port, backlog=1024)
    gate = StartGate(manifest.mode)
    server = _Server(_uvicorn_config(manifest, gate))
    serving = asyncio.create_task(server.serve(sockets=[sock]))
    # uvicorn's own start (its config, its protocol classes) before the workers' spawns take the CPU
    for _ in range(100):
        if server.started or serving.done():
            break
        await asyncio.sleep(0.005)
    try:
        starting = asyncio.create_task(_start(manifest, runtime, tokenizer, progress))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 130
        stopper.cancel()
        api, lifespan = starting.result()
        async with lifespan():
            gate.open(build_api(api))
            _print_ready(manifest, runtime, api, url)
            freeze_heap("router")  # its pass (~20 ms) after the ready line, not before it
            # the warm spare for restarts, once the first requests had the CPU (its imports: seconds);
            # none once a drain has begun
            loop.call_later(SPARE_DELAY_S, lambda: stop.is_set() or runtime.start_standby())
            await serving
        return 0
    finally:
        server.should_exit = True
        await asyncio.gather(serving, return_exceptions=True)
        sock.close()
        await runtime.stop()


def _uvicorn_config(manifest: Manifest, app: StartGate) -> uvicorn.Config:
    """The router's HTTP server: `app` (the start gate, then the API), the deployment's read limits and
    drain time; no uvicorn lifespan (`run_manifest` runs the API's around its serving)."""
    srv = manifest.server
    limits = ReadLimits(srv.header_timeout_s, srv.body_timeout_s, srv.max_header_bytes)
    return uvicorn.Config(app, log_level="warning", lifespan="off", ws="none",
                          timeout_graceful_shutdown=int(manifest.runtime.drain_timeout_s),
                          timeout_keep_alive=KEEP_ALIVE_S, http=guarded_protocol(limits))  # fmt: skip


async def _start(
    manifest: Manifest, runtime: LocalRuntime, tokenizer: Tokenizer | None, progress: bool
) -> tuple[OpenAIServer, Callable[[], contextlib.AbstractAsyncContextManager[None]]]:
    """Start the workers, make the API and warm the path up; -> the API and the context its background
    tasks (KV prober, stats line) run in while it serves."""
    await runtime.start(progress=progress)
    mark("workers")
    first = runtime.workers[0].health
    assert first is not None  # started: its ready line is in
    defaults, source = generation_defaults(manifest.model.generation_config, first.model)
    log.info("%s", describe_defaults(defaults, source))
    names = manifest.model.served_names()
    info = ModelInfo(names[0], first.max_model_len, first.vocab_size, first.model,
                     aliases=tuple(names[1:]), generation_defaults=defaults)  # fmt: skip
    api = OpenAIServer(
        manifest, runtime, tokenizer, info, runtime.describe, lambda: _worker_stats(runtime),
        runtime.worker_headers,
    )  # fmt: skip
    # POST /admin/workers/{name}/role, and a scaling controller's entry point (runtime.change_role)
    switcher = RoleSwitcher(runtime, api.metrics.registry, info.served_name)
    api.change_role = runtime.change_role = switcher.switch
    prober = KVProber(manifest, runtime.ready, api.on_probe, runtime.worker_headers)
    stats_line = StatsLogger(api, manifest.server.log_stats_interval_s)
    scaling = None
    if manifest.scaling.enabled:
        from splitserve.runtime.local_scale import local_controller

        scaling = local_controller(manifest, runtime, api, lambda: _worker_stats(runtime))

    @contextlib.asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        prober.start()
        stats_line.start()
        if scaling is not None:
            scaling.start()
        try:
            yield
        finally:
            if scaling is not None:
                await scaling.stop()
            api.admission.closed = True
            await stats_line.stop()
            await api.metrics_cache.stop()
            await prober.stop()
            await api.dispatcher.close()

    if manifest.runtime.warm_up:
        await warm_up(api.dispatcher, [w.role for w in runtime.workers], info.vocab_size)
        mark("warm_up")
    return api, lifespan


def _print_ready(manifest: Manifest, runtime: LocalRuntime, api: OpenAIServer, url: str) -> None:
    name = api.info.served_name
    pools = ", ".join(f"{w.name} {w.url}" for w in runtime.workers)
    startup = startup_report.report(process_age_s(), phases(marks()), runtime.describe())
    # one line (with --log-format json, the only one not JSON): the banner, then where the time went
    took = startup_report.line(startup)
    print(f"splitserve: serving {name} at {url}/v1 ({manifest.mode}; {pools}); {took}", flush=True)
    print(json.dumps({"event": "ready", "url": url, "model": name, "mode": manifest.mode,
                      "workers": runtime.describe(), "cuda_mps": runtime.mps_state(),
                      "generation_defaults": api.info.generation_defaults, "startup": startup}),
          file=sys.stderr, flush=True)  # fmt: skip


__all__ = ["run_manifest"]
