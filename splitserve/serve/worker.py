"""The worker service's front end: one engine-core process (core.py) behind HTTP (worker_app.py).

    python -m splitserve.serve.worker --role prefill --model PATH --port 0 --kv-backend tcp \
        --kv-secret-env SPLITSERVE_KV_SECRET

prints one JSON line `{"event": "ready", "url": ..., "kv_address": ..., ...}` once it serves (ports
come from the OS), then logs to stderr. Two processes: this one (HTTP, tokenization, detokenization,
stop strings, streams) and the engine core it starts (the device, the engine, the KV transport), joined
by core_protocol.py. If the core dies, every request in flight fails at once and this process exits
too, so that the runtime restarts the worker.

Roles and the life of a disaggregated request through two workers (the router drives it):
  1. prefill worker, POST /prefill {prompt_token_ids, sampling_params}: the core runs the prompt,
     samples the first token, leases the blocks (and hybrid state) to the KV transport, and the answer
     is {first_token, kv: {handle, generator_state}}. Unclaimed, the lease ends after --kv-lease-s.
  2. decode worker, POST /decode {prompt_token_ids, first_token, kv, sampling_params}: the core
     reserves blocks, fetches (the transport's handshake checks the layout and the shared secret on
     first contact), has the prefill lease released, joins the batch, and this process streams NDJSON
     lines from the first token on. A failed fetch follows --kv-policy (or the body's kv_policy):
     "fail" answers an HTTP error before any line; "recompute" recomputes the prompt and streams the
     same tokens.
  colocated worker: POST /generate only (every role serves /generate: a whole request on one engine).
All roles: POST /abort, GET /health, GET /stats (queues, free blocks and state slots, KV counters).
KV plumbing: POST /kv/connect (decode: handshake with a prefill worker now, to check a pair),
POST /kv/release (prefill: end an export's lease now), POST /debug/faults (--enable-fault-injection).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import os
import secrets
import signal
import sys
import time
from collections.abc import AsyncIterator, Sequence
from typing import Any

from splitserve.engine.grammar import check_grammar
from splitserve.kv import TransportError
from splitserve.model.errors import ModelLoadError
from splitserve.serve import core_protocol as wire
from splitserve.serve.core_client import CoreClient, CoreDead, RequestStream
from splitserve.serve.core_ops import RoleError
from splitserve.serve.schemas import (
    DecodeRequest,
    FaultsRequest,
    GenerateRequest,
    KVExportBody,
    PrefillRequest,
    PrefillResponse,
    StreamLine,
    logprob_from_dict,
    sampling_params,
)
from splitserve.serve.text_stream import TextStream
from splitserve.serve.worker_auth import worker_headers, worker_token  # noqa: F401 - re-exported
from splitserve.serve.worker_cli import build_parser, config_from_args
from splitserve.serve.worker_config import ROLES, WorkerConfig

log = logging.getLogger(__name__)

__all__ = ["ROLES", "RoleError", "Worker", "WorkerConfig"]


class Worker:
    """prefill / decode / generate / abort / health / stats over one engine core (the same class a Ray
    deployment wraps)."""

    def __init__(self, config: WorkerConfig, client: CoreClient | None = None) -> None:
        from splitserve.model.tokenizer import load_tokenizer

        self.config = config
        self.client = client or CoreClient.spawn()
        level = logging.getLevelName(logging.getLogger().getEffectiveLevel())
        self.client.begin(config, log_level=level)
        try:
            # while the core loads the weights
            self.tokenizer = load_tokenizer(config.engine.model, config.engine.tokenizer)
        except Exception:
            self.client.close()
            raise
        self.info = self.client.wait_ready()
        self.kv_address: str | None = self.info.get("kv_address")
        self._ids = itertools.count()
        self._tag = secrets.token_hex(4)  # request ids unique across workers: decode keeps them

    def attach(self, loop: asyncio.AbstractEventLoop) -> None:
        """From the event loop that serves HTTP, before the first request."""
        self.client.attach(loop)

    def alive(self) -> bool:
        return self.client.dead is None

    def _new_id(self, kind: str) -> str:
        return f"{kind}-{self._tag}-{next(self._ids)}"

    def _need(self, role: str) -> None:
        if self.config.role != role:
            raise RoleError(f"this is a {self.config.role} worker: only a {role} worker serves that")

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if not isinstance(prompt, str):
            return [int(t) for t in prompt]
        if self.tokenizer is None:
            raise ValueError("this worker has no tokenizer: pass prompt token ids")
        return self.tokenizer.encode(prompt)

    @staticmethod
    async def _params(data: dict[str, Any]) -> Any:
        """Checked whole here (a grammar parsed off the loop, cached): the core gets nothing bad."""
        params = sampling_params(data)
        if params.n != 1:
            raise ValueError("a worker serves one sample per request (n = 1): the router fans out n")
        if params.grammar is not None:
            await asyncio.to_thread(check_grammar, params.grammar)  # GrammarError: a 400
        return params

    # ---- requests --------------------------------------------------------------------------------

    async def prefill(self, req: PrefillRequest) -> PrefillResponse:
        self._need("prefill")
        params = await self._params(req.sampling_params)
        ids = self._prompt_ids(req.prompt_input())
        rid = req.request_id or self._new_id("pf")
        start = time.perf_counter()
        stream = self.client.add(rid, ids, req.sampling_params, export=True)
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
        text = TextStream(rid, params, self.tokenizer)
        line = text.feed(deltas)
        assert line is not None and line.token_ids
        kv = last.kv
        if text.finished and kv is not None:  # a stop string ended it at once: nothing to hand on
            await self.client.call("release", kv=kv)
            kv = None
        return PrefillResponse(
            request_id=rid, first_token=line.token_ids[0], text=line.text,
            finish_reason=text.finish_reason if text.finished else None, kv=kv,
            seconds=time.perf_counter() - start, logprob=line.logprobs[0] if line.logprobs else None,
            prompt_token_ids=ids, metrics=deltas[0].metrics or {},
        )  # fmt: skip

    async def decode(self, req: DecodeRequest) -> AsyncIterator[StreamLine]:
        """Lines from the first token on; a failed import (CoreError) comes before the first line."""
        self._need("decode")
        params = await self._params(req.sampling_params)
        rid = req.request_id or req.kv.handle.request_id or self._new_id("dc")
        lp = None
        if req.first_logprob is not None:
            x = logprob_from_dict(req.first_logprob)
            lp = [x.token_id, x.logprob, x.rank, [list(t) for t in x.top]]
        cmd = wire.Import(rid, list(req.prompt_token_ids), req.first_token, req.kv.model_dump(),
                          req.sampling_params, lp, req.kv_policy, req.timeout_s)  # fmt: skip
        stream = self.client.import_kv(cmd)
        async for line in self._lines(rid, stream, TextStream(rid, params, self.tokenizer), timings=False):
            yield line

    async def generate(self, req: GenerateRequest) -> AsyncIterator[StreamLine]:
        params = await self._params(req.sampling_params)
        ids = self._prompt_ids(req.prompt_input())
        rid = req.request_id or self._new_id("gen")
        stream = self.client.add(rid, ids, req.sampling_params)
        async for line in self._lines(rid, stream, TextStream(rid, params, self.tokenizer), timings=True):
            yield line

    async def _lines(
        self, rid: str, stream: RequestStream, text: TextStream, timings: bool
    ) -> AsyncIterator[StreamLine]:
        """Deltas -> lines, at least `stream_interval` tokens each; closing early aborts the request.
        The first line carries where the time went (this engine's queue/prefill, or the KV import)."""
        done = False
        interval = self.config.stream_interval
        try:
            info = await stream.accepted
            while True:
                deltas = await stream.take()
                while (
                    interval > 1
                    and not deltas[-1].finished
                    and sum(len(d.token_ids) for d in deltas) < interval
                ):
                    deltas += await stream.take()
                metrics = None
                if text.tokens == 0:
                    metrics = (deltas[0].metrics or {}) if timings else dict(info)
                line = text.feed(deltas, metrics)
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

    def health(self) -> dict:
        status = "ok" if self.alive() else "engine_dead"
        if status == "ok" and self.client.stopped():
            status = "engine_stopped"  # answered with a 503: missed health checks get it replaced
        return {**self.info, "status": status, "pid": os.getpid()}

    async def stats(self) -> dict:
        return await self.client.call("stats")

    async def check_peer(self, address: str, timeout_s: float) -> dict:
        """Handshake with an exporter now (decode side); refused pairs raise CoreError (403 / 409)."""
        if self.config.role == "colocated":
            raise RoleError("a colocated worker has no KV transport")
        return await self.client.call(
            "check_peer", wait_s=timeout_s + 5, address=address, timeout_s=timeout_s
        )

    async def release(self, kv: KVExportBody) -> dict:
        self._need("prefill")
        return await self.client.call("release", kv=kv.model_dump())

    async def probe_export(self, num_blocks: int) -> dict:
        self._need("prefill")
        return await self.client.call("probe_export", num_blocks=num_blocks)

    async def probe(self, kv: KVExportBody, timeout_s: float) -> dict:
        self._need("decode")
        return await self.client.call("probe", wait_s=timeout_s + 5, kv=kv.model_dump(), timeout_s=timeout_s)

    async def set_faults(self, knobs: FaultsRequest) -> dict:
        return await self.client.call("set_faults", **knobs.model_dump())

    async def close(self) -> None:
        await asyncio.to_thread(self.client.close)


# ---- command line --------------------------------------------------------------------------------


STANDBY = "--standby"


def standby() -> list[str]:
    """A warm spare: import what the front end needs (the HTTP stack, the tokenizer) while its engine
    core, already started, imports torch and the engine (and makes a CUDA context where there is a
    GPU); say so, and wait for the worker's command line as one JSON line on stdin. The local runtime
    keeps one, so that a restart skips interpreter start-up and imports (seconds)."""
    import splitserve.model.tokenizer  # noqa: F401 - the import is the point
    import splitserve.serve.worker_app  # noqa: F401

    print(json.dumps({"event": "standby", "pid": os.getpid()}), flush=True)
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the runtime went away
    argv = json.loads(line)["argv"]
    if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
        raise SystemExit('splitserve worker: a standby wants {"argv": [str, ...]}')
    return argv


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    # SIGTERM before serving (a standby told to go): unwind, so that the core and its sockets go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    client = CoreClient.spawn()  # the core imports torch and the engine meanwhile
    try:
        if argv == [STANDBY]:
            argv = standby()
        args = build_parser().parse_args(argv)
    except SystemExit:
        client.close(1)
        raise
    from splitserve.logs import setup_logging

    setup_logging(logging.INFO if args.verbose else logging.WARNING)  # as the router: text or JSON
    from splitserve.serve.worker_app import serve

    try:
        config = config_from_args(args)
        worker = Worker(config, client)
    except SystemExit:  # SIGTERM while loading
        client.close(1)
        raise
    except (ValueError, OSError, ModelLoadError, TransportError, CoreDead) as exc:
        client.close(1)
        if not isinstance(exc, CoreDead):  # the core said why itself, on our stderr
            print(f"splitserve worker: error: {exc}", file=sys.stderr)
        return 2

    def ready(url: str) -> None:
        from splitserve.serve.heap import freeze_heap

        freeze_heap("worker front end")
        info = {"event": "ready", "url": url, **worker.health()}
        print(json.dumps(info), flush=True)

    serve(worker, config.kv_host, args.port, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
