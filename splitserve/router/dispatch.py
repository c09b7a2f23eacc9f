"""The router: picks workers and drives one completion choice through them, with a deadline per stage.

Disaggregated, one choice (`Dispatcher.run`):
  1. pick a prefill worker (policy) and POST /prefill, bounded by `timeouts.prefill_s`: the prompt
     runs there, the first token is sampled and the KV is leased; the answer carries the KV handle.
  2. pick a decode worker (least loaded) and POST /decode with the handle, streamed: the worker
     reserves blocks, fetches the KV (bounded by `timeouts.kv_transfer_s`), releases the lease and
     streams NDJSON lines from the first token on; between two lines at most `timeouts.inter_token_s`.
  Colocated: one POST /generate, streamed, on a colocated worker.
Every failure becomes an `APIError` with a status that says what happened (502 a worker failed or
died, 503 no worker is ready, 504 a stage ran past its deadline, 4xx the worker refused the input).
If the caller goes away (task cancelled), both workers are told to abort the request, and an export
not yet claimed by a decode worker is released at once: nothing stays allocated.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import itertools
import json
import logging
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiohttp
import msgspec
from pydantic import BaseModel

from splitserve.config.manifest_sections import RouterSection
from splitserve.router.idle_deadline import IdleDeadline
from splitserve.router.openai_protocol import APIError
from splitserve.wire.http import (
    LINE_DECODER,
    AbortRequest,
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResponse,
    ReleaseRequest,
    StreamLine,
)

log = logging.getLogger(__name__)


class WorkerEndpoint(Protocol):
    name: str
    role: str
    url: str | None
    inflight: int

    @property
    def ready(self) -> bool: ...


class WorkerSet(Protocol):
    def ready(self, role: str) -> Sequence[WorkerEndpoint]: ...


@dataclass
class Piece:
    """New output of one choice: tokens, their text and logprobs, and whether it is the last."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[dict] | None = None
    finish_reason: str | None = None
    finished: bool = False
    metrics: dict[str, Any] = field(default_factory=dict)  # the first piece: where the time went


class Picker:
    """round_robin | least_loaded | prefix_affinity (prefill and colocated; decode: least loaded)."""

    def __init__(self, config: RouterSection, block_size: int = 16) -> None:
        self.config = config
        self.block_size = block_size
        self._rr = itertools.count()

    def pick(self, workers: Sequence[WorkerEndpoint], role: str, prompt_ids: Sequence[int]) -> WorkerEndpoint:
        if not workers:
            raise APIError(
                503,
                f"no {role} worker is ready (starting or restarting); retry shortly",
                type="service_unavailable",
                code="no_ready_worker",
                headers={"Retry-After": "2"},
            )
        policy = self.config.policy if role != "decode" else "least_loaded"
        if len(workers) == 1:
            return workers[0]
        if policy == "round_robin":
            return workers[next(self._rr) % len(workers)]
        least = min(workers, key=lambda w: (w.inflight, next(self._rr) % len(workers)))
        if policy == "least_loaded":
            return least
        # prefix affinity: rendezvous hashing of the prompt's leading whole blocks, so that prompts
        # sharing a prefix land where that prefix is cached; overloaded -> the least loaded instead.
        n = min(len(prompt_ids), self.config.affinity_prefix_tokens)
        n -= n % self.block_size
        if n == 0:
            return least
        key = ",".join(map(str, prompt_ids[:n])).encode()
        chosen = max(workers, key=lambda w: hashlib.blake2b(key + w.name.encode(), digest_size=8).digest())
        if chosen.inflight - least.inflight > self.config.affinity_max_imbalance:
            return least
        return chosen


class Dispatcher:
    """Drives choices through the workers (see the module doc)."""

    def __init__(
        self,
        workers: WorkerSet,
        config: RouterSection,
        mode: str,
        block_size: int = 16,
        headers: dict[str, str] | None = None,  # the worker API's bearer token
    ) -> None:
        self.workers = workers
        self.config = config
        self.mode = mode
        self.picker = Picker(config, block_size)
        self.headers = headers or {}
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()

    @property
    def http(self) -> aiohttp.ClientSession:
        """aiohttp (its C HTTP parser) for the workers' streams: one line per engine step per request
        goes through here, so its cost per chunk is the router's cost per token."""
        if self._session is None or self._session.closed:
            t = self.config.timeouts
            self._session = aiohttp.ClientSession(
                headers={**self.headers, "Content-Type": "application/json"},
                timeout=aiohttp.ClientTimeout(total=t.request_s, sock_connect=t.connect_s),
                connector=aiohttp.TCPConnector(limit=4096, limit_per_host=0, keepalive_timeout=30),
                json_serialize=lambda obj: msgspec.json.encode(obj).decode(),
            )
        return self._session

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        if self._session is not None:
            await self._session.close()

    def _later(self, coro: Any) -> None:
        """Fire and forget (an abort or a release), surviving the caller's cancellation."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_quietly(self, worker: WorkerEndpoint, path: str, body: BaseModel) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeouts.connect_s)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.http.post(f"{worker.url}{path}", data=_json(body), timeout=timeout) as r:
                await r.read()

    # ---- one choice -----------------------------------------------------------------------------

    async def run(
        self, index: int, prompt_ids: list[int], params: dict[str, Any], request_id: str
    ) -> AsyncIterator[Piece]:
        if self.mode == "colocated":
            worker = self.picker.pick(self.workers.ready("colocated"), "colocated", prompt_ids)
            body = GenerateRequest(prompt_token_ids=prompt_ids, sampling_params=params, request_id=request_id)
            async for piece in self._stream(
                worker, "/generate", body, index, request_id, self.config.timeouts.prefill_s
            ):
                yield piece
            return
        async for piece in self._disaggregated(index, prompt_ids, params, request_id):
            yield piece

    async def _disaggregated(
        self, index: int, prompt_ids: list[int], params: dict[str, Any], rid: str
    ) -> AsyncIterator[Piece]:
        t = self.config.timeouts
        pf = self.picker.pick(self.workers.ready("prefill"), "prefill", prompt_ids)
        body = PrefillRequest(prompt_token_ids=prompt_ids, sampling_params=params, request_id=rid)
        start = time.perf_counter()
        pf.inflight += 1
        try:
            async with asyncio.timeout(t.prefill_s):
                async with self.http.post(f"{pf.url}/prefill", data=_json(body)) as resp:
                    status, content = resp.status, await resp.read()
        except aiohttp.ClientError as exc:  # first: aiohttp's connect timeout is a TimeoutError too
            raise _worker_failed(pf, "prefill", exc) from None
        except TimeoutError:
            self._later(self._post_quietly(pf, "/abort", AbortRequest(request_id=rid)))
            raise APIError(
                504,
                f"the prefill stage ran past its deadline ({t.prefill_s:g}s) on {pf.name}",
                type="timeout",
                code="prefill_timeout",
            ) from None
        except asyncio.CancelledError:
            self._later(self._post_quietly(pf, "/abort", AbortRequest(request_id=rid)))
            raise
        finally:
            pf.inflight -= 1
        if status != 200:
            raise _worker_error(pf, status, content)
        pre = PrefillResponse.model_validate_json(content)
        prefill_wall = time.perf_counter() - start
        metrics = {**pre.metrics, "prefill_wall_s": prefill_wall, "prefill_worker": pf.name}
        if pre.kv_export is None:  # the first token ended it
            lps = None if pre.logprob is None else [pre.logprob]
            yield Piece(index, [pre.first_token], pre.text, lps, pre.finish_reason, True, metrics)
            return
        kv_export = pre.kv_export
        try:
            dc = self.picker.pick(self.workers.ready("decode"), "decode", prompt_ids)
        except APIError:
            self._later(self._post_quietly(pf, "/kv/release", ReleaseRequest(kv_export=kv_export)))
            raise
        dbody = DecodeRequest(
            prompt_token_ids=prompt_ids, first_token=pre.first_token, first_logprob=pre.logprob,
            kv_export=kv_export, sampling_params=params, request_id=rid, timeout_s=t.kv_transfer_s,
            stream=True,
        )  # fmt: skip
        claimed = False
        try:
            async for piece in self._stream(dc, "/decode", dbody, index, rid, t.kv_transfer_s + t.connect_s):
                if not claimed:
                    claimed = True
                    piece.metrics = {**metrics, **piece.metrics}
                yield piece
        finally:
            if not claimed:  # the decode worker never took the KV: give it back now, not at lease end
                self._later(self._post_quietly(pf, "/kv/release", ReleaseRequest(kv_export=kv_export)))

    async def _stream(
        self, worker: WorkerEndpoint, path: str, body: BaseModel, index: int, rid: str, first_timeout_s: float
    ) -> AsyncIterator[Piece]:
        """POST an NDJSON-streaming endpoint; each line -> a Piece. Deadlines: `first_timeout_s` for
        the first line (the worker's status and headers included: a worker answers them only with its
        first line), `inter_token_s` between lines."""
        t = self.config.timeouts
        stage = "kv transfer" if path == "/decode" else "prefill"
        worker.inflight += 1
        done, first = False, True
        decode = LINE_DECODER.decode
        try:
            try:
                # One deadline context for the whole stream, re-armed lazily (idle_deadline.py).
                # NOTE: it stays armed across `yield`: the one consumer (`Run._one`) never awaits
                # between two pieces, so it can only fire while the answer or a line is awaited.
                async with asyncio.timeout(None) as cm:
                    idle = IdleDeadline(cm, first_timeout_s)
                    try:
                        async with self.http.post(f"{worker.url}{path}", data=_json(body)) as resp:
                            if resp.status != 200:
                                raise _worker_error(worker, resp.status, await resp.read())
                            async for raw in _lines(resp.content):
                                line = decode(raw)
                                idle.touch(t.inter_token_s)
                                first, done = False, line.finished
                                yield _piece(worker, line, index)  # raises for an unfinished end
                                if done:
                                    return
                    finally:
                        idle.stop()
            except aiohttp.ClientError:
                raise  # aiohttp's own connect timeout is a TimeoutError too: a failed worker, not a deadline
            except TimeoutError:
                what = f"the {stage} stage" if first else "the next token"
                span = first_timeout_s if first else t.inter_token_s
                raise APIError(
                    504,
                    f"{what} ran past its deadline ({span:g}s) on {worker.name}",
                    type="timeout",
                    code="worker_timeout",
                ) from None
            raise APIError(
                502,
                f"worker {worker.name} closed the stream before the request finished (it may have died)",
                type="server_error",
                code="worker_failed",
            )
        except (aiohttp.ClientError, msgspec.DecodeError) as exc:
            raise _worker_failed(worker, stage, exc) from None
        finally:
            worker.inflight -= 1
            if not done:  # cancelled, timed out or failed: make sure the worker lets go of it
                self._later(self._post_quietly(worker, "/abort", AbortRequest(request_id=rid)))


async def _lines(content: aiohttp.StreamReader) -> AsyncIterator[bytes]:
    """The body's lines, however long (aiohttp's readline stops at 64 KiB), empty ones skipped."""
    buf = b""
    while True:
        chunk = await content.readany()
        if not chunk:
            if buf.strip():
                yield buf
            return
        buf += chunk
        if b"\n" not in chunk:
            continue
        *full, buf = buf.split(b"\n")
        for line in full:
            if line:
                yield line


def _piece(worker: WorkerEndpoint, line: StreamLine, index: int) -> Piece:
    if line.finished and line.finish_reason in (None, "abort", "error"):
        raise APIError(
            502,
            f"worker {worker.name} ended the request without finishing it ({line.finish_reason})",
            type="server_error",
            code="worker_aborted",
        )
    return Piece(index, line.token_ids, line.text, line.logprobs, line.finish_reason, line.finished,
                 line.metrics or {})  # fmt: skip


def _json(body: BaseModel) -> bytes:
    return body.model_dump_json().encode()


def _one(lp: dict | None) -> list[dict] | None:
    return None if lp is None else [lp]


def _worker_failed(worker: WorkerEndpoint, stage: str, exc: BaseException) -> APIError:
    return APIError(
        502,
        f"the {stage} worker {worker.name} failed: {type(exc).__name__}: {exc}".rstrip(": "),
        type="server_error",
        code="worker_failed",
    )


def _worker_error(worker: WorkerEndpoint, status: int, content: bytes) -> APIError:
    """A worker's error answer -> the client's: its input errors stay 400, the rest are ours."""
    try:
        err = json.loads(content).get("error", {})
        message, kind = err.get("message", ""), err.get("type", "")
    except (ValueError, AttributeError):
        message, kind = content[:200].decode(errors="replace"), ""
    if status == 400:
        return APIError(400, message or "the worker refused the request")
    if status == 504:
        return APIError(504, f"{worker.name}: {message}", type="timeout", code="kv_transfer_timeout")
    if status == 503:
        return APIError(
            503,
            f"{worker.name}: {message}",
            type="service_unavailable",
            code=kind or None,
            headers={"Retry-After": "1"},
        )
    return APIError(
        502, f"{worker.name} answered {status}: {message}", type="server_error", code=kind or None
    )


__all__ = ["Dispatcher", "Piece", "Picker"]
