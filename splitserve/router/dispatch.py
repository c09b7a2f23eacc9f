"""The router: picks workers and drives one completion choice through them, with a deadline per stage.

Disaggregated, one choice (`Dispatcher.run`):
  1. pick a prefill worker (policy) and POST /prefill, bounded by `timeouts.prefill_s`: the prompt
     runs there, the first token is sampled and the KV is leased; the answer carries the KV handle.
  2. pick a decode worker (least loaded) and POST /decode with the handle, streamed: the worker
     reserves blocks, fetches the KV (bounded by `timeouts.kv_transfer_s`), releases the lease and
     streams NDJSON lines from the first token on; between two lines at most `timeouts.inter_token_s`.
     Streamed under `router.first_token: prefill`, the first token goes to the client between the two
     steps, and the decode stream goes on without it (first_token.py).
  Colocated: one POST /generate, streamed, on a colocated worker.
A worker's fault under a choice (its process or engine core died, its stream was cut) migrates the choice
to another worker, which goes on from the tokens already streamed (migrate.py). Every other failure
becomes an `APIError` with a status that says what happened (502 a worker failed or died and the choice
was not migrated, 503 no worker became ready in time, 504 a stage ran past its deadline, 4xx the worker
refused the input). While every worker of a role is (re)starting, a choice waits for one (`_pick`).
If the caller goes away (task cancelled), both workers are told to abort the request, and an export
not yet claimed by a decode worker is released at once: nothing stays allocated.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import itertools
import logging
import time
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any, Protocol

import aiohttp
import msgspec

from splitserve.config.manifest_sections import RouterSection
from splitserve.router.cache_follow import CacheFollower
from splitserve.router.cache_metrics import CacheMetrics
from splitserve.router.cache_policy import CacheAwarePolicy, Choice
from splitserve.router.first_token import SentFirst, early_piece
from splitserve.router.idle_deadline import IdleDeadline
from splitserve.router.migrate import KV_FAULTS, Attempt, migrating
from splitserve.router.openai_protocol import APIError
from splitserve.router.worker_answers import (
    Piece,
    WorkerEndpoint,
    as_json,
    lines,
    piece,
    stamp,
    stream_cut,
    timings,
    worker_error,
    worker_failed,
)
from splitserve.sampling.params import SamplingParams
from splitserve.wire.http import (
    LINE_DECODER,
    AbortRequest,
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResponse,
    ReleaseRequest,
)

log = logging.getLogger(__name__)


class WorkerSet(Protocol):
    def ready(self, role: str) -> Sequence[WorkerEndpoint]: ...


class Picker:
    """round_robin | least_loaded | prefix_affinity | cache_aware (prefill and colocated; decode: least
    loaded). cache_aware scores the replicas' prefix caches against their load (cache_policy.py)."""

    def __init__(
        self, config: RouterSection, block_size: int = 16, cache: CacheAwarePolicy | None = None
    ) -> None:
        self.config = config
        self.block_size = block_size
        self.cache = cache
        self._rr = itertools.count()

    def choose(self, workers: Sequence[WorkerEndpoint], role: str, prompt_ids: Sequence[int]) -> Choice:
        """The pick with what cache-aware routing expects of it (`Choice.done()` when its prefill ended)."""
        if self.cache is not None and role != "decode" and len(workers) > 1:
            return self.cache.choose(workers, prompt_ids, self._by_hash)
        return Choice(self.pick(workers, role, prompt_ids))

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
        if policy == "least_loaded":
            return self._least(workers)
        return self._by_hash(workers, prompt_ids)  # prefix_affinity, and cache_aware's fallback

    def _least(self, workers: Sequence[WorkerEndpoint]) -> WorkerEndpoint:
        """The worker with the fewest requests in flight; ties go round the workers, one pick a step."""
        start, n = next(self._rr), len(workers)
        i = min(range(n), key=lambda i: (workers[i].inflight, (i - start) % n))
        return workers[i]

    def _by_hash(self, workers: Sequence[WorkerEndpoint], prompt_ids: Sequence[int]) -> WorkerEndpoint:
        """Prefix affinity: rendezvous hashing of the prompt's leading whole blocks, so that prompts
        sharing a prefix land where that prefix is cached; overloaded -> the least loaded instead."""
        least = self._least(workers)
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
        self.headers = headers or {}
        self.follower: CacheFollower | None = None  # cache_aware: the replicas' caches, from their events
        cache = None
        if config.policy == "cache_aware":
            roles = ("colocated",) if mode == "colocated" else ("prefill",)
            self.follower = CacheFollower(workers, roles, config.cache_aware, self.headers,
                                          config.timeouts.connect_s)  # fmt: skip
            cache = CacheAwarePolicy(config, block_size, self.follower)
            with contextlib.suppress(RuntimeError):  # no loop running yet: the first pick starts it
                asyncio.get_running_loop()
                self.follower.start()
        self.picker = Picker(config, block_size, cache)
        self._session: aiohttp.ClientSession | None = None
        self._background: set[asyncio.Task] = set()
        self.on_migrated: Callable[[str], None] | None = None  # counts a migration by cause (migrate.py)

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

    def cache_metrics(self, registry: Any, model: str) -> None:
        """cache_aware: export its picks, estimates and views (cache_metrics.py) in `registry`."""
        if self.follower is None or self.picker.cache is None:
            return
        m = CacheMetrics(registry, model)
        stale_s = self.config.cache_aware.stale_s
        self.follower.on_index = lambda idx: m.watch(idx, stale_s)
        self.follower.on_resync = m.resynced
        self.picker.cache.metrics = m

    async def close(self) -> None:
        if self.follower is not None:
            await self.follower.stop()
        if self._background:
            await asyncio.wait(self._background, timeout=5)
        if self._session is not None:
            await self._session.close()

    def _later(self, coro: Any) -> None:
        """Fire and forget (an abort or a release), surviving the caller's cancellation."""
        task = asyncio.create_task(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _post_quietly(self, worker: WorkerEndpoint, path: str, body: msgspec.Struct) -> None:
        timeout = aiohttp.ClientTimeout(total=self.config.timeouts.connect_s)
        with contextlib.suppress(aiohttp.ClientError, TimeoutError):
            async with self.http.post(f"{worker.url}{path}", data=as_json(body), timeout=timeout) as r:
                await r.read()

    # ---- one choice -----------------------------------------------------------------------------

    def run(
        self, index: int, prompt_ids: list[int], params: SamplingParams, request_id: str,
        deadline: float | None = None, stream: bool = False, paced: bool = False,
    ) -> AsyncIterator[Piece]:  # fmt: skip
        """The choice's pieces; `deadline` (time.perf_counter()): the request's, which bounds waits for
        a worker and migrations; `stream`: the client reads them as they come (`router.first_token`);
        `paced`: the caller hands the pieces on to another task, and sets an early first piece's `taken`
        once that task has written it out (`Run`): the decode request waits for it. Unpaced, asking for
        the next piece says the last one is out."""
        early = stream and self.config.first_token == "prefill"
        attempt = functools.partial(self._attempt, early=early, paced=early and paced)
        return migrating(attempt, self.config, index, prompt_ids, params, request_id, deadline,
                         self.on_migrated)  # fmt: skip

    async def _attempt(
        self, index: int, ids: list[int], params: SamplingParams, rid: str, resumed: int, at: Attempt,
        early: bool = False, paced: bool = False,
    ) -> AsyncIterator[Piece]:  # fmt: skip
        """One try at a choice (migrate.py): `ids` the prompt, its last `resumed` tokens the completion's
        own (streamed before a fault)."""
        if self.mode == "colocated":
            choice = await self._pick("colocated", ids, at)
            body = GenerateRequest(prompt_token_ids=ids, sampling_params=params, request_id=rid,
                                   resumed=resumed)  # fmt: skip
            first_s = self.config.timeouts.prefill_s
            try:
                async for p in self._stream(choice.worker, "/generate", body, index, rid, first_s):
                    choice.done(p.metrics.get("cached_tokens"))  # the first piece carries the timings
                    yield p
            finally:
                choice.done()
            return
        async for p in self._disaggregated(index, ids, params, rid, resumed, at, early, paced):
            yield p

    async def _pick(self, role: str, prompt_ids: Sequence[int], at: Attempt) -> Choice:
        """A ready worker of `role` that `at` may use; while there is none but one is (re)starting, wait
        for it, up to `router.worker_wait_s` and the request's deadline; then a 503."""
        until = time.perf_counter() + self.config.worker_wait_s
        until = until if at.deadline is None else min(until, at.deadline)
        coming = getattr(self.workers, "coming", None)  # the runtime's: is one of `role` on its way?
        if self.follower is not None:
            self.follower.start()
        while True:
            workers = [w for w in self.workers.ready(role) if at.allowed(w)]
            if workers or time.perf_counter() >= until or (coming is not None and not coming(role)):
                choice = self.picker.choose(workers, role, prompt_ids)  # none: a 503
                at.on(choice.worker)
                return choice
            await asyncio.sleep(0.05)

    async def _disaggregated(
        self, index: int, prompt_ids: list[int], params: SamplingParams, rid: str, resumed: int, at: Attempt,
        early: bool = False, paced: bool = False,
    ) -> AsyncIterator[Piece]:  # fmt: skip
        t = self.config.timeouts
        await self._pick("decode", prompt_ids, at)  # none ready: wait before a prefill holds KV for it
        choice = await self._pick("prefill", prompt_ids, at)
        pf = choice.worker
        body = PrefillRequest(prompt_token_ids=prompt_ids, sampling_params=params, request_id=rid,
                              resumed=resumed, stamp=stamp(pf))  # fmt: skip
        start = time.perf_counter()
        pf.inflight += 1
        status: int | None = None
        try:
            async with asyncio.timeout(t.prefill_s):
                async with self.http.post(f"{pf.url}/prefill", data=as_json(body)) as resp:
                    status, content = resp.status, await resp.read()
        except aiohttp.ClientError as exc:  # first: aiohttp's connect timeout is a TimeoutError too
            raise worker_failed(pf, "prefill", exc) from None
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
                choice.done()
        if status != 200:
            raise worker_error(pf, status, content)
        try:
            pre = msgspec.json.decode(content, type=PrefillResponse)
        except msgspec.DecodeError:
            choice.done()
            raise
        choice.done(pre.timings.cached_tokens)  # the prefill is over: its work leaves the replica's load
        prefill_wall = time.perf_counter() - start
        metrics = {**timings(pre.timings), "prefill_wall_s": prefill_wall, "prefill_worker": pf.name}
        if pre.kv_export is None:  # the first token ended it
            lps = None if pre.logprob is None else [pre.logprob]
            yield Piece(index, [pre.first_token], pre.text, lps, pre.finish_reason, True, metrics)
            return
        kv_export, claimed = pre.kv_export, False
        try:
            if early:  # the first token now; a fault from here on is mid-stream (migrate.py)
                first = early_piece(index, pre, metrics, paced)
                yield first
                if first.taken is not None:  # paced: wait until it is written out, so that making the
                    await first.taken.wait()  # decode request is off its way (a cancel lands here)
            dc = (await self._pick("decode", prompt_ids, at)).worker
            dbody = DecodeRequest(
                prompt_token_ids=prompt_ids, first_token=pre.first_token, first_logprob=pre.logprob,
                kv_export=kv_export, sampling_params=params, request_id=rid, timeout_s=t.kv_transfer_s,
                stream=True, resumed=resumed, stamp=stamp(dc),
            )  # fmt: skip
            sent = SentFirst(pre, rid) if early else None
            async for p in self._stream(dc, "/decode", dbody, index, rid, t.kv_transfer_s + t.connect_s):
                if not claimed:
                    claimed = True
                    p.metrics = p.metrics if early else {**metrics, **p.metrics}
                yield p if sent is None else sent(p)
        except APIError as exc:
            if not claimed and exc.code in KV_FAULTS:
                at.on(pf)  # the KV did not come from the prefill worker: it is the one to avoid
            raise
        finally:
            if not claimed:  # the decode worker never took the KV: give it back now, not at lease end
                self._later(self._post_quietly(pf, "/kv/release", ReleaseRequest(kv_export=kv_export)))

    async def _stream(
        self,
        worker: WorkerEndpoint,
        path: str,
        body: msgspec.Struct,
        index: int,
        rid: str,
        first_timeout_s: float,
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
                        async with self.http.post(f"{worker.url}{path}", data=as_json(body)) as resp:
                            if resp.status != 200:
                                raise worker_error(worker, resp.status, await resp.read())
                            async for raw in lines(resp.content):
                                line = decode(raw)
                                idle.touch(t.inter_token_s)
                                first, done = False, line.finished
                                yield piece(worker, line, index)  # raises for an unfinished end
                                if done:
                                    return
                    finally:
                        idle.stop()
            except aiohttp.ClientError:
                raise  # aiohttp's own connect timeout is a TimeoutError too: a failed worker, not a deadline
            except TimeoutError:
                what = f"the {stage} stage" if first else "the next token"
                span = first_timeout_s if first else t.inter_token_s
                code = "worker_timeout" if first else "worker_stalled"  # stalled mid-stream: migrated
                raise APIError(504, f"{what} ran past its deadline ({span:g}s) on {worker.name}",
                               type="timeout", code=code) from None  # fmt: skip
            raise stream_cut(worker)
        except (aiohttp.ClientError, msgspec.DecodeError) as exc:
            raise worker_failed(worker, stage, exc) from None
        finally:
            worker.inflight -= 1
            if not done:  # cancelled, timed out or failed: make sure the worker lets go of it
                self._later(self._post_quietly(worker, "/abort", AbortRequest(request_id=rid)))


__all__ = ["Dispatcher", "Piece", "Picker", "WorkerEndpoint", "WorkerSet"]
