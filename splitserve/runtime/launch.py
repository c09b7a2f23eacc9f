"""`splitserve serve`: start a manifest's workers (local runtime), then the OpenAI API in front of them.

Order of events: workers spawn and load weights (a progress bar over workers; each worker's log lines
are prefixed with its name) -> the tokenizer loads in this process -> the API binds and prints
`splitserve: serving MODEL at URL` (tests read it) -> requests. SIGTERM or SIGINT: the API stops
accepting, in-flight requests get `runtime.drain_timeout_s` to finish, then the workers are stopped
(SIGTERM, then SIGKILL). A second signal skips the drain.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import sys
from collections.abc import AsyncIterator, Generator

import uvicorn

from splitserve.config.manifest import Manifest
from splitserve.model.tokenizer import load_tokenizer
from splitserve.router.chat_template import use_chat_template
from splitserve.router.probe import KVProber
from splitserve.router.routes import build_api
from splitserve.router.server import ModelInfo, OpenAIServer
from splitserve.router.stats_log import StatsLogger
from splitserve.router.warmup import warm_up
from splitserve.runtime.local import LocalRuntime
from splitserve.web.edge_guard import ReadLimits, guarded_protocol
from splitserve.web.listen import KEEP_ALIVE_S, listen

log = logging.getLogger(__name__)


class _Server(uvicorn.Server):
    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:  # we install our own (run_manifest)
        yield


async def _worker_stats(runtime: LocalRuntime, timeout_s: float = 2.0) -> list[dict]:
    async def one(w) -> dict:  # noqa: ANN001
        row = {"worker": w.name, "role": w.role, "up": w.ready}
        if w.ready:
            with contextlib.suppress(Exception):
                r = await runtime._http.get(f"{w.url}/stats", timeout=timeout_s)
                row.update(r.json())
        return row

    return list(await asyncio.gather(*(one(w) for w in runtime.workers)))


async def run_manifest(manifest: Manifest, progress: bool = True) -> int:
    if manifest.runtime.kind != "local":
        raise ValueError(
            f"runtime.kind {manifest.runtime.kind!r} is not available from `splitserve serve` yet"
        )
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    signals = 0
    server: _Server | None = None

    def on_signal() -> None:
        nonlocal signals
        signals += 1
        if signals == 1 and api is not None:  # a second before uvicorn's own drain timeout ends
            cut_at = max(0.0, manifest.runtime.drain_timeout_s - 1.0)
            loop.call_later(cut_at, lambda: api is not None and api.cut_streams())
        stop.set()
        if server is not None:
            server.should_exit = True
            server.force_exit = signals > 1
        log.warning("signal received: %s", "draining" if signals == 1 else "stopping now")

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, on_signal)

    # bind first: a busy port fails fast
    sock, url = listen(manifest.server.host, manifest.server.port, backlog=1024)
    api: OpenAIServer | None = None

    def on_event(kind: str, worker: object) -> None:
        if api is not None:
            api.on_worker_event(kind, worker)

    runtime = LocalRuntime(manifest, on_event)
    try:
        starting = asyncio.create_task(runtime.start(progress=progress))
        stopper = asyncio.create_task(stop.wait())
        await asyncio.wait({starting, stopper}, return_when=asyncio.FIRST_COMPLETED)
        if not starting.done():
            starting.cancel()
            return 130
        stopper.cancel()
        starting.result()
        first = runtime.workers[0].info
        tokenizer = await asyncio.to_thread(load_tokenizer, first["model"], first.get("tokenizer"))
        use_chat_template(tokenizer, manifest.model.chat_template)
        info = ModelInfo(manifest.model.resolved_served_name(), int(first["max_model_len"]),
                         int(first["vocab_size"]), first["model"],
                         aliases=tuple(manifest.model.served_names()[1:]))  # fmt: skip
        api = OpenAIServer(
            manifest, runtime, tokenizer, info, runtime.describe, lambda: _worker_stats(runtime),
            runtime.worker_headers,
        )  # fmt: skip
        prober = KVProber(manifest, runtime.ready, api.on_probe, runtime.worker_headers)
        stats_line = StatsLogger(api, manifest.server.log_stats_interval_s)

        @contextlib.asynccontextmanager
        async def lifespan(_app: object) -> AsyncIterator[None]:
            prober.start()
            stats_line.start()
            yield
            api.admission.closed = True
            await stats_line.stop()
            await api.metrics_cache.stop()
            await prober.stop()
            await api.dispatcher.close()

        srv = manifest.server
        limits = ReadLimits(srv.header_timeout_s, srv.body_timeout_s, srv.max_header_bytes)
        config = uvicorn.Config(build_api(api, lifespan), log_level="warning", lifespan="on",
                                timeout_graceful_shutdown=int(manifest.runtime.drain_timeout_s),
                                timeout_keep_alive=KEEP_ALIVE_S, http=guarded_protocol(limits))  # fmt: skip
        server = _Server(config)
        from splitserve.heap import freeze_heap

        if manifest.runtime.warm_up:
            await warm_up(api.dispatcher, [w.role for w in runtime.workers], info.vocab_size)
        freeze_heap("router")
        pools = ", ".join(f"{w.name} {w.url}" for w in runtime.workers)
        print(f"splitserve: serving {info.served_name} at {url}/v1 ({manifest.mode}; {pools})", flush=True)
        print(json.dumps({"event": "ready", "url": url, "model": info.served_name, "mode": manifest.mode,
                          "workers": runtime.describe(), "cuda_mps": runtime.mps_state()}),
              file=sys.stderr, flush=True)  # fmt: skip
        if not stop.is_set():
            await server.serve(sockets=[sock])
        return 0
    finally:
        sock.close()
        await runtime.stop()


__all__ = ["run_manifest"]
