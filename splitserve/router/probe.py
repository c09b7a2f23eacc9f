"""The KV probe: real blocks over the real transport between one prefill and one decode worker.

`probe_pair` asks the prefill worker to lease N free blocks (POST /kv/probe/export), has the decode
worker fetch them into its own free blocks and time it (POST /kv/probe), and returns what the decode
side measured: bytes, seconds, GB/s and the backend that moved them. Both sides give the blocks back.
The gate (`splitserve verify`) runs it once per pair with `verify.probe_mb`; `KVProber` runs a small one
per pair every `verify.probe_interval_s` while serving and publishes the results as metrics, which the
shipped alert rules (deploy/prometheus/alerts.yaml) watch.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from typing import Any

import httpx
import msgspec

from splitserve.config.manifest import Manifest
from splitserve.wire.http import ProbeExportRequest, ProbeRequest, ReleaseRequest
from splitserve.wire.ops import ProbeExported, ProbeResult

log = logging.getLogger(__name__)


class ProbeError(RuntimeError):
    pass


_encode = msgspec.json.Encoder().encode
_JSON = {"Content-Type": "application/json"}


async def probe_pair(
    http: httpx.AsyncClient, prefill_url: str, decode_url: str, num_blocks: int, timeout_s: float = 30.0
) -> ProbeResult:
    ask = _encode(ProbeExportRequest(num_blocks=num_blocks))
    r = await http.post(f"{prefill_url}/kv/probe/export", content=ask, headers=_JSON, timeout=timeout_s)
    if r.status_code != 200:
        raise ProbeError(f"probe export on {prefill_url} failed ({r.status_code}): {_message(r)}")
    kv_export = msgspec.json.decode(r.content, type=ProbeExported).kv_export
    body = _encode(ProbeRequest(kv_export=kv_export, timeout_s=timeout_s))
    r = await http.post(f"{decode_url}/kv/probe", content=body, headers=_JSON, timeout=timeout_s + 5)
    if r.status_code != 200:
        with contextlib.suppress(httpx.HTTPError):
            release = _encode(ReleaseRequest(kv_export=kv_export))
            await http.post(f"{prefill_url}/kv/release", content=release, headers=_JSON, timeout=5)
        raise ProbeError(f"probe fetch on {decode_url} failed ({r.status_code}): {_message(r)}")
    return msgspec.json.decode(r.content, type=ProbeResult)


def blocks_for(mb: float, block_bytes: int) -> int:
    return max(1, int(mb * (1 << 20)) // block_bytes)


def _message(r: httpx.Response) -> str:
    try:
        return r.json()["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return r.text[:200]


class KVProber:
    """Run time: one small probe per ready prefill/decode pair every `probe_interval_s`; results go to
    `on_result(prefill, decode, result | None, error | None)`."""

    def __init__(
        self,
        manifest: Manifest,
        workers: Callable[[str], Sequence[Any]],
        on_result: Callable[[str, str, ProbeResult | None, str | None], None],
        headers: dict[str, str] | None = None,
    ) -> None:
        self.manifest = manifest
        self.workers = workers
        self.on_result = on_result
        self.http = httpx.AsyncClient(timeout=30, headers=headers or {})
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        if self.manifest.mode == "disaggregated" and self.manifest.verify.probe_interval_s > 0:
            self._task = asyncio.create_task(self._loop(), name="kv-prober")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        await self.http.aclose()

    async def probe_once(self) -> None:
        v = self.manifest.verify
        for p in self.workers("prefill"):
            for d in self.workers("decode"):
                n = blocks_for(v.runtime_probe_mb, (d.health.block_bytes if d.health else 0) or 1 << 20)
                try:
                    res = await probe_pair(self.http, p.url, d.url, n)
                except (ProbeError, httpx.HTTPError) as exc:
                    log.warning("kv probe %s -> %s failed: %s", p.name, d.name, exc)
                    self.on_result(p.name, d.name, None, str(exc))
                else:
                    self.on_result(p.name, d.name, res, None)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.manifest.verify.probe_interval_s)
            try:
                await self.probe_once()
            except Exception:  # noqa: BLE001 - the prober must outlive one bad round
                log.exception("kv probe round failed")


__all__ = ["KVProber", "ProbeError", "blocks_for", "probe_pair"]
