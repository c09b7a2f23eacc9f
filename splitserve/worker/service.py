"""`Worker`: a worker's operations (prefill / decode / generate / abort / health / stats) over its engine
core, with tokenization, detokenization and stop strings on this side. app.py puts it behind HTTP,
runtime/ray_serve.py behind a Ray deployment; main.py is the process's entry point (roles and the life of
a disaggregated request are told there)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Callable
from typing import TypeVar

from msgspec.structs import replace

from splitserve.config.worker import WorkerConfig
from splitserve.core.ops import RoleError
from splitserve.core.share import CORES_PREFIX
from splitserve.sampling.grammar_check import check_grammar
from splitserve.sampling.params import SamplingParams
from splitserve.tempdirs import remove_if_orphaned
from splitserve.wire import core as wire
from splitserve.wire import ops
from splitserve.wire.http import (
    DecodeRequest,
    GenerateRequest,
    PrefillRequest,
    PrefillResponse,
    StreamLine,
    Timings,
)
from splitserve.wire.kv_events import CacheLoad, KVEventsPage, KVEventsQuery
from splitserve.wire.kv_handle import KVExport
from splitserve.wire.role import ROLE_CHANGED, RoleStamp
from splitserve.wire.stats import Health, WorkerStats
from splitserve.worker.core_client import CoreClient, CoreDead, RequestStream
from splitserve.worker.kv_events import KVEventFeed
from splitserve.worker.text_stream import TextStream

R = TypeVar("R")
log = logging.getLogger(__name__)
SWITCHABLE = ("prefill", "decode")
LOAD_WAIT_S = 1.0  # a heartbeat waits this long at most for the engine's load (between two steps)


class StaleRole(Exception):
    """A call made for a role or role epoch this worker no longer has, or made while it changes role:
    answered 409 `stale_role`, on which the router picks a worker again."""

    def __init__(self, message: str, role: str, epoch: int) -> None:
        super().__init__(message)
        self.role, self.epoch = role, epoch


class Worker:
    """prefill / decode / generate / abort / health / stats over one engine core (the same class a Ray
    deployment wraps)."""

    def __init__(
        self,
        config: WorkerConfig,
        client: CoreClient | None = None,
        while_loading: Callable[[], None] | None = None,
    ) -> None:
        """Starts the engine core on `config` and waits for it; `while_loading` runs meanwhile, once the
        tokenizer is loaded (the front end's own start-up work, off the core's path to ready)."""
        from splitserve.model.tokenizer import load_tokenizer

        self.config = config
        self.client = client or CoreClient.spawn()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.client.begin(config, log_level=level)
        try:
            # while the core loads the weights
            self.tokenizer = load_tokenizer(config.engine.model, config.engine.tokenizer)
            if while_loading is not None:
                while_loading()
        except Exception:
            self.client.close()
            raise
        self.info = self.client.wait_ready()
        self.kv_address: str | None = self.info.kv_address
        self.kv_events = self._publish_cache(self.client)
        self._ids = itertools.count()
        self._tag = secrets.token_hex(4)  # request ids unique across workers: decode keeps them
        self.switching = False  # the engine core is being replaced for another role (change_role)
        self.next_core: CoreClient | None = None  # a core started ahead of a role change (prepare_role)

    def _publish_cache(self, client: CoreClient) -> KVEventFeed:
        """The prefix cache's changes as `client`'s core reports them, for cache-aware routers (GET
        /kv/events). A new core's cache starts empty: a new feed, with a new epoch, follows it."""
        feed = KVEventFeed(self.config.engine.block_size)
        client.on_cache_events = feed.apply
        return feed

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """From the event loop that serves HTTP, before the first request."""
        self.client.attach(loop)

    def alive(self) -> bool:
        return self.client.dead is None

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{self._tag}-{next(self._ids)}"

    def _need(self, role: str, stamp: RoleStamp | None = None) -> None:
        self._check_stamp(stamp)
        if self.config.role != role:
            raise RoleError(f"this is a {self.config.role} worker: only a {role} worker serves that")

    def _check_stamp(self, stamp: RoleStamp | None) -> None:
        """409 for a call stamped with another role or epoch than this worker's, or made while it changes
        role (stamped or not)."""
        role, epoch = self.config.role, self.config.role_epoch
        if self.switching:
            raise StaleRole(f"this worker is changing role (from {role}, epoch {epoch})", role, epoch)
        if stamp is not None and (stamp.role != role or stamp.epoch != epoch):
            raise StaleRole(f"this worker is a {role} worker at role epoch {epoch}; the call was made for a "
                            f"{stamp.role} worker at epoch {stamp.epoch}", role, epoch)  # fmt: skip

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return prompt  # a fresh list of ints: the body's decoding checked each (wire/http.py)
        if self.tokenizer is None:
            raise ValueError("this worker has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt)

    @staticmethod
    async def _params(params: SamplingParams) -> SamplingParams:
        """Checked whole here (a grammar parsed off the loop, cached): the core gets nothing bad."""
        if params.n != 1:
            raise ValueError("a worker serves one sample per request (n = 1): the router fans out n")
        if params.grammar is not None:
            await asyncio.to_thread(check_grammar, params.grammar)  # GrammarError: a 400
        return params

    def _text(self, rid: str, params: SamplingParams, ids: list[int], resumed: int) -> TextStream:
        text = TextStream(rid, params, self.tokenizer)
        if resumed:
            text.resume(ids[-resumed:])
        return text

    # ---- requests --------------------------------------------------------------------------------

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        self._need("prefill", req.stamp)
        params = await self._params(req.sampling_params)
        ids = self._prompt_ids(req.prompt_input())
        rid = req.request_id or self._new_id("pf")
        start = time.perf_counter()
        stream = self.client.add(rid, ids, core_params(_resumed(params, ids, req.resumed)), export=True)
        deltas: list[wire.Delta] = []
        try:
            await stream.accepted
            while not (deltas and deltas[-1].finished):
                deltas += await stream.take()
        except BaseException:
            self.client.cancel(rid)
            raise
        last = deltas[-1]
        if last.finish_reason in ("error", "abort"):
            raise RuntimeError(f"prefill of {rid} ended without a first token ({last.finish_reason})")
        text = self._text(rid, params, ids, req.resumed)
        line = text.feed(deltas)
        assert line is not None and line.token_ids
        kv_export = last.kv_export
        if text.finished and kv_export is not None:  # a stop string ended it at once: nothing to hand on
            await self.client.call(ops.Release(self.client.call_id(), kv_export))
            kv_export = None
        return PrefillResponse(
            request_id=rid, first_token=line.token_ids[0], text=line.text,
            finish_reason=text.finish_reason if text.finished else None, kv_export=kv_export,
            seconds=time.perf_counter() - start, logprob=line.logprobs[0] if line.logprobs else None,
            prompt_token_ids=ids, timings=deltas[0].timings or Timings(),
        )  # fmt: skip

    async def decode(self, req: DecodeRequest) -> AsyncIterator[StreamLine]:
        """Lines from the first token on; a failed import (CoreError) comes before the first line."""
        self._need("decode", req.stamp)
        params = await self._params(req.sampling_params)
        rid = req.request_id or req.kv_export.handle.request_id or self._new_id("dc")
        ids = list(req.prompt_token_ids)
        engine_params = core_params(_resumed(params, ids, req.resumed))
        cmd = wire.Import(rid, ids, req.first_token, req.kv_export, engine_params, req.first_logprob,
                          req.kv_policy, req.timeout_s)  # fmt: skip
        stream = self.client.import_kv(cmd)
        async for line in self._lines(rid, stream, self._text(rid, params, ids, req.resumed), timings=False):
            yield line

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamLine]:
        params = await self._params(req.sampling_params)
        ids = self._prompt_ids(req.prompt_input())
        rid = req.request_id or self._new_id("gen")
        stream = self.client.add(rid, ids, core_params(_resumed(params, ids, req.resumed)))
        async for line in self._lines(rid, stream, self._text(rid, params, ids, req.resumed), timings=True):
            yield line

    async def _lines(
        self, rid: str, stream: RequestStream, text: TextStream, timings: bool
    ) -> AsyncIterator[StreamLine]:
        """Deltas -> lines, at least `stream_interval` tokens each after the first; closing early aborts
        the request. The first line carries where the time went (this engine's queue/prefill, or the
        KV import)."""
        done = False
        interval = self.config.stream_interval
        held: list[wire.Delta] = []  # deltas taken with the first one, sent in the next line
        try:
            imported = await stream.accepted
            while True:
                deltas, held = held or await stream.take(), []
                if text.tokens == 0 and len(deltas) > 1:  # the first line carries the first delta alone
                    deltas, held = deltas[:1], deltas[1:]
                while (  # the first line goes at once (TTFT); later ones hold `interval` tokens
                    interval > 1
                    and text.tokens > 0
                    and not deltas[-1].finished
                    and sum(len(d.token_ids) for d in deltas) < interval
                ):
                    deltas += await stream.take()
                first = None
                if text.tokens == 0:
                    first = (deltas[0].timings if timings else imported) or Timings()
                line = text.feed(deltas, first)
                if text.stopped_early:
                    self.client.cancel(rid)
                if line is None:
                    continue
                done = line.finished
                yield line
                if done:
                    return
        finally:
            if not done:
                self.client.cancel(rid)  # the caller went away, or the stream failed
            elif not text.stopped_early:
                self.client.forget(rid)

    def abort(self, request_id: str) -> None:
        self.client.abort(request_id)

    # ---- operations ------------------------------------------------------------------------------

    def health(self) -> Health:
        status = "ok" if self.alive() else "engine_dead"
        if status == "ok" and self.client.stopped():
            status = "engine_stopped"  # answered with a 503: missed health checks get it replaced
        if status == "ok" and self.switching:
            status = "switching"
        return replace(self.info, status=status, pid=os.getpid(), role_epoch=self.config.role_epoch)

    async def stats(self) -> WorkerStats:
        return _expect(await self.client.call(ops.GetStats(self.client.call_id())), WorkerStats)

    async def cache_events(self, query: KVEventsQuery) -> KVEventsPage:
        """The prefix cache's events after `query.after`, or a snapshot (worker/kv_events.py). A page
        without events (a heartbeat, a snapshot) carries the engine's load as of now, not as of its last
        cache change (a request that ended changed no cache)."""
        page = await self.kv_events.page(query)
        if not page.events:
            with contextlib.suppress(TimeoutError, wire.CoreError):
                st = await asyncio.wait_for(self.stats(), LOAD_WAIT_S)
                page.load = self.kv_events.load = CacheLoad(st.unfinished, st.blocks.free, st.blocks.total)
        return page

    async def check_peer(
        self, address: str, timeout_s: float, stamp: RoleStamp | None = None
    ) -> ops.PeerChecked:
        """Handshake with an exporter now (decode side); refused pairs raise CoreError (403 / 409)."""
        self._check_stamp(stamp)
        if self.config.role == "colocated":
            raise RoleError("a colocated worker has no KV transport")
        op = ops.CheckPeer(self.client.call_id(), address, timeout_s)
        return _expect(await self.client.call(op, wait_s=timeout_s + 5), ops.PeerChecked)

    async def release(self, kv_export: KVExport, stamp: RoleStamp | None = None) -> ops.Ok:
        self._need("prefill", stamp)
        return _expect(await self.client.call(ops.Release(self.client.call_id(), kv_export)), ops.Ok)

    async def probe_export(self, num_blocks: int, stamp: RoleStamp | None = None) -> ops.ProbeExported:
        self._need("prefill", stamp)
        op = ops.ProbeExport(self.client.call_id(), num_blocks)
        return _expect(await self.client.call(op), ops.ProbeExported)

    async def probe(
        self, kv_export: KVExport, timeout_s: float, stamp: RoleStamp | None = None
    ) -> ops.ProbeResult:
        self._need("decode", stamp)
        op = ops.Probe(self.client.call_id(), kv_export, timeout_s)
        return _expect(await self.client.call(op, wait_s=timeout_s + 5), ops.ProbeResult)

    async def set_faults(self, knobs: ops.FaultKnobs) -> ops.FaultsSet:
        return _expect(await self.client.call(ops.SetFaults(self.client.call_id(), knobs)), ops.FaultsSet)

    def prepare_role(self) -> None:
        """A role change is coming (its drain has begun): start the next engine core now, so that its
        imports (and a GPU's context) are done by the time the old core stops."""
        if self.next_core is None:
            self.next_core = CoreClient.spawn()

    async def change_role(self, config: WorkerConfig) -> Health:
        """Serve `config`'s role from now on (its engine section, its side of the KV transport, its role
        epoch): requests still in flight fail as `role_changed` (503: the router migrates them), the old
        engine core stops (its KV pool and transport go with it) and a new one starts. The front end, its
        address, its tokenizer and its token stay. A core that does not start ends this process (the
        runtime restarts the worker, in its new role)."""
        if config.role not in SWITCHABLE or self.config.role not in SWITCHABLE:
            raise ValueError(f"a role change is between {SWITCHABLE}: {self.config.role} -> {config.role}")
        self._check_stamp(None)  # one change at a time
        config = dataclasses.replace(config, kv_secret=self.config.kv_secret)
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.switching = True
        old, new = self.client, self.next_core or CoreClient.spawn()  # it imports while the old one stops
        self.next_core = None
        why = f"the worker changes role ({self.config.role} -> {config.role})"
        failed = old.fail_all(wire.ErrorInfo(503, ROLE_CHANGED, why))
        await asyncio.sleep(0)  # the failed requests' handlers run before the old sockets close
        await asyncio.to_thread(old.close)
        try:
            new.begin(config, log_level=level)
            info = await asyncio.to_thread(new.wait_ready)
        except CoreDead as exc:
            if old.on_death is not None:
                old.on_death(f"the engine core for the {config.role} role did not start: {exc}")
            raise
        new.on_death = old.on_death
        self.kv_events = self._publish_cache(new)
        new.attach(asyncio.get_running_loop())
        self.client, self.config, self.info, self.kv_address = new, config, info, info.kv_address
        self.switching = False
        log.info("%s: %d requests in flight handed back; role epoch now %d", why, failed,
                 config.role_epoch)  # fmt: skip
        return self.health()

    async def close(self) -> None:
        if self.next_core is not None:
            await asyncio.to_thread(self.next_core.close)
        await asyncio.to_thread(self.client.close)
        if self.config.core_share:  # a runtime that was SIGKILLed cannot remove its folder of lent cores
            remove_if_orphaned(os.path.dirname(self.config.core_share), CORES_PREFIX)


def _resumed(params: SamplingParams, ids: list[int], resumed: int) -> SamplingParams:
    """The sampling params of a migrated request, whose last `resumed` prompt tokens are its completion's
    first: they count against max_tokens and min_tokens, and the engine takes them as the request's own
    output (`SamplingParams.resumed`: a seeded generator's draws, the penalties)."""
    if not resumed:
        return params
    if resumed >= len(ids):
        raise ValueError(f"resumed ({resumed}) must be shorter than the prompt ({len(ids)} tokens)")
    if params.max_tokens is not None and params.max_tokens <= resumed:
        raise ValueError(f"resumed ({resumed}) leaves no room under max_tokens ({params.max_tokens})")
    max_tokens = None if params.max_tokens is None else params.max_tokens - resumed
    min_tokens = max(0, params.min_tokens - resumed)
    return replace(params, min_tokens=min_tokens, max_tokens=max_tokens, resumed=resumed)


def core_params(params: SamplingParams) -> SamplingParams:
    """What the engine core runs with: no text (this front end detokenizes and cuts stop strings)."""
    return replace(params, stop=(), include_stop_str_in_output=False, detokenize=False)


def _expect(result: ops.OpResult, kind: type[R]) -> R:
    """An operation's result, of the type its operation answers with."""
    if not isinstance(result, kind):
        raise TypeError(f"the engine core answered {type(result).__name__}, expected {kind.__name__}")
    return result
