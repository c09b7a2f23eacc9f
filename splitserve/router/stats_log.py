"""The router's periodic stats line, as vLLM prints one every 10 s (`server.log_stats_interval_s`):

    2026-12-02 01:20:10,002 INFO splitserve.stats: Avg prompt throughput: 95.1 tokens/s, Avg generation
        throughput: 160.4 tokens/s, Running: 4 reqs, Waiting: 2 reqs, KV cache usage: 12.5%,
        Prefix cache hit rate: 40.0%

Throughputs are over the last interval (tokens of the requests that finished in it, from the router's
counters); running and waiting are summed over the workers' /stats (plus the router's own queue);
KV usage is the fullest worker's; the hit rate is prefix-cache hits / queries over the workers' life.
An idle deployment prints one line when it goes idle, then nothing until work comes back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from splitserve.router.server import OpenAIServer

log = logging.getLogger("splitserve.stats")


class StatsLogger:
    def __init__(self, server: OpenAIServer, interval_s: float) -> None:
        self.server = server
        self.interval_s = interval_s
        self._task: asyncio.Task | None = None
        self._last = (time.monotonic(), 0.0, 0.0)
        self._was_idle = True

    def start(self) -> None:
        if self.interval_s > 0 and self._task is None:
            self._last = (time.monotonic(), *self._tokens())
            self._task = asyncio.get_running_loop().create_task(self._loop())

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                await self.log_once()
            except Exception:  # noqa: BLE001 - a stats line must never take the router down
                log.debug("stats line failed", exc_info=True)

    def _tokens(self) -> tuple[float, float]:
        reg, lab = self.server.metrics.registry, {"model_name": self.server.info.served_name}
        prompt = reg.get_sample_value("splitserve:prompt_tokens_total", lab) or 0.0
        generated = reg.get_sample_value("splitserve:generation_tokens_total", lab) or 0.0
        return prompt, generated

    async def log_once(self) -> dict:
        """Compute the line's figures, log it unless idle twice running; -> the figures."""
        now, (prompt, generated) = time.monotonic(), self._tokens()
        then, prompt0, generated0 = self._last
        self._last = (now, prompt, generated)
        dt = max(now - then, 1e-6)
        rows = await self.server.worker_stats() if self.server.worker_stats is not None else []
        live = [r.stats for r in rows if r.stats is not None]
        usage = [u for u in (r.usage() for r in rows) if u is not None]
        queries = sum(s.prefix_cache.queries for s in live)
        hits = sum(s.prefix_cache.hits for s in live)
        fig = {
            "prompt_throughput": round((prompt - prompt0) / dt, 1),
            "generation_throughput": round((generated - generated0) / dt, 1),
            "running": sum(s.running for s in live),
            "waiting": sum(s.waiting for s in live) + self.server.admission.waiting,
            "kv_cache_usage": round(100 * max(usage, default=0.0), 1),
            "prefix_cache_hit_rate": round(100 * hits / queries, 1) if queries else 0.0,
        }
        idle = not any(fig[k] for k in ("prompt_throughput", "generation_throughput", "running", "waiting"))
        if not (idle and self._was_idle):
            log.info(
                "Avg prompt throughput: %.1f tokens/s, Avg generation throughput: %.1f tokens/s, "
                "Running: %d reqs, Waiting: %d reqs, KV cache usage: %.1f%%, Prefix cache hit rate: %.1f%%",
                *fig.values(),
                extra=fig,
            )
        self._was_idle = idle
        return fig


__all__ = ["StatsLogger"]
