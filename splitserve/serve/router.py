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

import httpx

from splitserve.config.manifest import RouterSection
from splitserve.serve.openai_protocol import APIError

log = logging.getLogger(__name__)


class Endpoint(Protocol):
    name: str
    role: str
    url: str | None
    inflight: int

    @property
    def ready(self) -> bool: ...


class WorkerSet(Protocol):
    def ready(self, role: str) -> Sequence[Endpoint]: ...


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

    def pick(self, workers: Sequence[Endpoint], role: str, prompt_ids: Sequence[int]) -> Endpoint:
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
        t = config.timeouts
        limits = httpx.Limits(max_connections=4096, max_keepalive_connections=256)
        timeout = httpx.Timeout(t.request_s, connect=t.connect_s)
        self.http = httpx.AsyncClient(timeout=timeout, limits=limits, headers=headers or {})
        self._background: set[asyncio.Task] = set()

    async def close(self) -> None:
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        await self.http.aclose()

    def _later(self, coro: Any) -> None:
        """Fire and forget (an abort or a release), surviving the caller's cancellation."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_quietly(self, worker: Endpoint, path: str, body: dict) -> None:
        with contextlib.suppress(httpx.HTTPError):
            await self.http.post(f"{worker.url}{path}", json=body, timeout=self.config.timeouts.connect_s)

    # ---- one choice -----------------------------------------------------------------------------

    async def run(
        self, index: int, prompt_ids: list[int], params: dict[str, Any], request_id: str
    ) -> AsyncIterator[Piece]:
        if self.mode == "colocated":
            worker = self.picker.pick(self.workers.ready("colocated"), "colocated", prompt_ids)
            body = {"prompt_token_ids": prompt_ids, "sampling_params": params, "request_id": request_id}
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
        body = {"prompt_token_ids": prompt_ids, "sampling_params": params, "request_id": rid}
        start = time.perf_counter()
        pf.inflight += 1
        try:
            resp = await asyncio.wait_for(self.http.post(f"{pf.url}/prefill", json=body), t.prefill_s)
        except TimeoutError:
            self._later(self._post_quietly(pf, "/abort", {"request_id": rid}))
            raise APIError(
                504,
                f"the prefill stage ran past its deadline ({t.prefill_s:g}s) on {pf.name}",
                type="timeout",
                code="prefill_timeout",
            ) from None
        except asyncio.CancelledError:
            self._later(self._post_quietly(pf, "/abort", {"request_id": rid}))
            raise
        except httpx.HTTPError as exc:
            raise _worker_failed(pf, "prefill", exc) from None
        finally:
            pf.inflight -= 1
        if resp.status_code != 200:
            raise _worker_error(pf, resp.status_code, resp.content)
        pre = resp.json()
        prefill_wall = time.perf_counter() - start
        metrics = {**pre.get("metrics", {}), "prefill_wall_s": prefill_wall, "prefill_worker": pf.name}
        if pre["kv"] is None:  # the first token ended it
            yield Piece(
                index,
                [pre["first_token"]],
                pre["text"],
                _one(pre.get("logprob")),
                pre["finish_reason"],
                True,
                metrics,
            )
            return
        kv = pre["kv"]
        try:
            dc = self.picker.pick(self.workers.ready("decode"), "decode", prompt_ids)
        except APIError:
            self._later(self._post_quietly(pf, "/kv/release", {"kv": kv}))
            raise
        body = {
            "prompt_token_ids": prompt_ids,
            "first_token": pre["first_token"],
            "first_logprob": pre.get("logprob"),
            "kv": kv,
            "sampling_params": params,
            "request_id": rid,
            "timeout_s": t.kv_transfer_s,
            "stream": True,
        }
        claimed = False
        try:
            async for piece in self._stream(dc, "/decode", body, index, rid, t.kv_transfer_s + t.connect_s):
                if not claimed:
                    claimed = True
                    piece.metrics = {**metrics, **piece.metrics}
                yield piece
        finally:
            if not claimed:  # the decode worker never took the KV: give it back now, not at lease end
                self._later(self._post_quietly(pf, "/kv/release", {"kv": kv}))

    async def _stream(
        self, worker: Endpoint, path: str, body: dict, index: int, rid: str, first_timeout_s: float
    ) -> AsyncIterator[Piece]:
        """POST an NDJSON-streaming endpoint; each line -> a Piece. Deadlines: `first_timeout_s` for
        the first line, `inter_token_s` between lines."""
        t = self.config.timeouts
        stage = "kv transfer" if path == "/decode" else "prefill"
        worker.inflight += 1
        done = False
        try:
            async with self.http.stream("POST", f"{worker.url}{path}", json=body) as resp:
                if resp.status_code != 200:
                    raise _worker_error(worker, resp.status_code, await resp.aread())
                lines = resp.aiter_lines()
                timeout, first = first_timeout_s, True
                while True:
                    try:
                        raw = await asyncio.wait_for(anext(lines), timeout)
                    except StopAsyncIteration:
                        break
                    except TimeoutError:
                        what = f"the {stage} stage" if first else "the next token"
                        raise APIError(
                            504,
                            f"{what} ran past its deadline ({timeout:g}s) on {worker.name}",
                            type="timeout",
                            code="worker_timeout",
                        ) from None
                    if not raw:
                        continue
                    line = json.loads(raw)
                    timeout, first = t.inter_token_s, False
                    piece = Piece(
                        index,
                        line["token_ids"],
                        line["text"],
                        line.get("logprobs"),
                        line.get("finish_reason"),
                        line["finished"],
                        line.get("metrics") or {},
                    )
                    if piece.finished:
                        done = True
                        if piece.finish_reason in (None, "abort", "error"):
                            raise APIError(
                                502,
                                f"worker {worker.name} ended the request without finishing it "
                                f"({piece.finish_reason})",
                                type="server_error",
                                code="worker_aborted",
                            )
                    yield piece
                    if done:
                        return
            raise APIError(
                502,
                f"worker {worker.name} closed the stream before the request finished (it may have died)",
                type="server_error",
                code="worker_failed",
            )
        except httpx.HTTPError as exc:
            raise _worker_failed(worker, stage, exc) from None
        finally:
            worker.inflight -= 1
            if not done:  # cancelled, timed out or failed: make sure the worker lets go of it
                self._later(self._post_quietly(worker, "/abort", {"request_id": rid}))


def _one(lp: dict | None) -> list[dict] | None:
    return None if lp is None else [lp]


def _worker_failed(worker: Endpoint, stage: str, exc: BaseException) -> APIError:
    return APIError(
        502,
        f"the {stage} worker {worker.name} failed: {type(exc).__name__}: {exc}".rstrip(": "),
        type="server_error",
        code="worker_failed",
    )


def _worker_error(worker: Endpoint, status: int, content: bytes) -> APIError:
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
