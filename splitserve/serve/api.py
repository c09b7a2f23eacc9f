"""The OpenAI-compatible HTTP API over the router: /v1/models, /v1/chat/completions, /v1/completions,
/health and /metrics.

A request's path through here: read the body (413 over `max_body_bytes`, 400 for bad JSON or UTF-8),
authenticate (401), validate (400, naming the field), check the model (404) and the context length
(400 with the numbers), tokenize, take a slot in the bounded queue (429 with Retry-After when it is
full, 503 when the wait runs past `queue_s`), then run every choice through the `Dispatcher`
concurrently. The answer starts only after the first piece of output has arrived, so a request that
fails before producing anything gets a real status; a failure after that is an SSE `error` event.
A client that goes away cancels its choices, which aborts them on the workers.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from splitserve.config.manifest import Manifest
from splitserve.engine.params import GrammarSpec
from splitserve.serve.access_log import AccessLog
from splitserve.serve.api_guard import DocsGuard, MetricsCache
from splitserve.serve.chat_template import render_chat, template_kwargs
from splitserve.serve.contain import ContainErrors
from splitserve.serve.json_edge import parse_json
from splitserve.serve.metrics import RouterMetrics, ttft_breakdown
from splitserve.serve.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    validate_body,
)
from splitserve.serve.responses import ResponseEvents, ResponsesRequest, response_object
from splitserve.serve.router import Dispatcher, Piece, WorkerSet
from splitserve.serve.structured import checked, requested_grammar
from splitserve.serve.tools import (
    ToolDeltas,
    ToolParser,
    chosen_tools,
    parser_for,
    render_messages,
    template_knows_tools,
    tool_grammar,
)
from splitserve.serve.utility_routes import install_utility_routes

log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    served_name: str
    max_model_len: int
    vocab_size: int
    root: str  # the checkpoint path
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()  # more names a request may give (--served-model-name A B)


class Admission:
    """At most `max_running` requests in flight; at most `max_queued` more waiting, for `timeout_s`."""

    def __init__(self, max_running: int, max_queued: int, timeout_s: float) -> None:
        self.max_queued = max_queued
        self.timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_running)
        self.running = 0
        self.waiting = 0
        self.closed = False

    async def acquire(self) -> float:
        """-> seconds waited. Raises APIError 429 (queue full) / 503 (waited too long, or draining)."""
        if self.closed:
            raise APIError(
                503,
                "the server is shutting down",
                type="service_unavailable",
                code="shutting_down",
                headers={"Retry-After": "5"},
            )
        start = time.perf_counter()
        if self._slots.locked():
            if self.waiting >= self.max_queued:
                raise APIError(
                    429,
                    f"the server is overloaded ({self.running} running, {self.waiting} queued); retry later",
                    type="rate_limit_error",
                    code="queue_full",
                    headers={"Retry-After": "1"},
                )
            self.waiting += 1
            try:
                await asyncio.wait_for(self._slots.acquire(), self.timeout_s)
            except TimeoutError:
                raise APIError(
                    503,
                    f"no capacity within {self.timeout_s:g}s; retry later",
                    type="service_unavailable",
                    code="queue_timeout",
                    headers={"Retry-After": "2"},
                ) from None
            finally:
                self.waiting -= 1
        else:
            await self._slots.acquire()
        self.running += 1
        return time.perf_counter() - start

    def release(self) -> None:
        self.running -= 1
        self._slots.release()


@dataclass
class _Choice:
    index: int
    prompt_len: int
    tokens: int = 0
    text: str = ""
    logprobs: list[dict] = field(default_factory=list)
    finish_reason: str | None = None
    last_time: float = 0.0


class OpenAIServer:
    def __init__(
        self,
        manifest: Manifest,
        workers: WorkerSet,
        tokenizer: Any,
        info: ModelInfo,
        describe_workers: Callable[[], list[dict]] = list,
        worker_stats: Callable[[], Awaitable[list[dict]]] | None = None,
        worker_headers: dict[str, str] | None = None,
    ) -> None:
        """`describe_workers()`: every worker's name, role, state, url, kv address, restarts and its
        last /health; `worker_stats()`: each ready worker's /stats (for /metrics); `worker_headers`:
        what calls to the workers carry (their API's bearer token)."""
        self.manifest = manifest
        self.workers = workers
        self.tokenizer = tokenizer
        self.info = info
        self.describe_workers = describe_workers
        self.worker_stats = worker_stats
        self.keys = [k.encode() for k in manifest.server.keys()]
        self.dispatcher = Dispatcher(
            workers, manifest.router, manifest.mode, manifest.engine.block_size, worker_headers
        )
        srv = manifest.server
        self.admission = Admission(
            srv.max_concurrent_requests, srv.max_queued_requests, manifest.router.timeouts.queue_s
        )
        self.metrics = RouterMetrics(info.served_name)
        self.metrics.kv_min_gbps.labels(info.served_name).set(manifest.verify.min_gbps)
        self.metrics.prime(manifest.transport.backend)
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        template = getattr(getattr(tokenizer, "hf", None), "chat_template", None)
        self.tool_format = parser_for(template)  # the model family's tool-call syntax (tools.py)
        self.native_tools = template_knows_tools(template)
        # the per-token metrics, bound to their labels once (a .labels() lookup per token adds up)
        self.metrics_cache = MetricsCache(self.render_metrics)  # one render per 0.25 s at most
        self.runs: set[_Run] = set()  # requests in flight (cut_streams ends them at the drain deadline)
        self.itl = self.metrics.itl.labels(info.served_name)
        self.generated = self.metrics.generation_tokens.labels(info.served_name)

    def _token_text(self, token_id: int) -> str:
        return self.tokenizer.token_text(token_id) if self.tokenizer is not None else str(token_id)

    # ---- request plumbing -----------------------------------------------------------------------

    def check_auth(self, request: Request) -> None:
        if not self.keys:
            return
        header = request.headers.get("authorization", "")
        scheme, _, token = header.partition(" ")
        ok, token = False, token.strip().encode()
        for key in self.keys:  # every key compared, in constant time each
            ok |= hmac.compare_digest(token, key)
        if scheme.lower() != "bearer" or not token or not ok:  # an empty token never passes
            raise APIError(
                401,
                "invalid or missing API key (send 'Authorization: Bearer <key>')",
                code="invalid_api_key",
                headers={"WWW-Authenticate": "Bearer"},
            )

    async def read_json(self, request: Request) -> dict:
        limit = self.manifest.server.max_body_bytes
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise APIError(
                413, f"the request body is {length} bytes; the limit is {limit}", code="request_too_large"
            )
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise APIError(
                        413, f"the request body exceeds the limit of {limit} bytes", code="request_too_large"
                    )
                chunks.append(chunk)
        except ClientDisconnect:  # one access-log line (499, as nginx counts it), no traceback
            raise APIError(
                499, "the client closed the connection before its body arrived", code="client_closed_request"
            ) from None
        raw = b"".join(chunks)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise APIError(400, f"the request body is not valid UTF-8: {exc}", code="invalid_utf8") from None
        try:
            body = parse_json(text)
        except ValueError as exc:  # json.JSONDecodeError is one
            raise APIError(400, f"the request body is not valid JSON: {exc}", code="invalid_json") from None
        if not isinstance(body, dict):
            raise APIError(400, "the request body must be a JSON object", code="invalid_json")
        return body

    def check_model(self, name: str) -> None:
        if name != self.info.served_name and name not in self.info.aliases:
            raise APIError(
                404,
                f"The model `{name}` does not exist; this server serves `{self.info.served_name}`",
                param="model",
                code="model_not_found",
            )

    def check_length(self, prompt_len: int, max_tokens: int | None, what: str) -> None:
        limit = self.info.max_model_len
        if prompt_len >= limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, your "
                f"{what} resulted in {prompt_len} tokens, which leaves no room for a completion. "
                f"Please reduce the length of the {what}.",
                param=what,
                code="context_length_exceeded",
            )
        if max_tokens is not None and prompt_len + max_tokens > limit:
            raise APIError(
                400,
                f"This model's maximum context length is {limit} tokens. However, you "
                f"requested {prompt_len + max_tokens} tokens ({prompt_len} in the {what}, "
                f"{max_tokens} in the completion). Please reduce the length of the {what} or "
                "completion.",
                param="max_tokens",
                code="context_length_exceeded",
            )

    # ---- chat and completions -------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        start = time.perf_counter()
        self.check_auth(request)
        return await self.chat_body(await self.read_json(request), request, start)

    async def responses(self, request: Request) -> Response:
        """/v1/responses: translated to a chat request, its answer translated back (responses.py)."""
        start = time.perf_counter()
        self.check_auth(request)
        req = validate_body(ResponsesRequest, await self.read_json(request))
        answer = await self.chat_body(req.to_chat(), request, start)
        ours = {k: v for k, v in answer.headers.items() if k.startswith("x-")}  # the request id, TTFT parts
        if isinstance(answer, _Stream):
            events = ResponseEvents(req, self.info.served_name).sse(answer.body_iterator)
            return _Stream(events, answer.cleanup, media_type="text/event-stream", headers=ours)
        body = response_object(req, self.info.served_name, msgspec.json.decode(answer.body))
        return JSONResponse(body, headers=ours)

    async def chat_body(self, body: dict, request: Request, start: float) -> Response:
        req = validate_body(ChatCompletionRequest, body)
        self.check_model(req.model)
        self._check_n(req.n)
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
        offered = [t.model_dump(exclude_none=True) for t in req.tools or []]
        tools, mode = chosen_tools(offered, req.tool_choice)
        messages = render_messages(req.messages, tools, self.native_tools)
        kwargs = template_kwargs(req.chat_template_kwargs, self.manifest.server.trust_request_chat_template)
        if tools and self.native_tools:
            kwargs["tools"] = tools
        prompt_ids = await render_chat(
            self.tokenizer, messages, req.add_generation_prompt, req.continue_final_message, kwargs
        )
        self.check_length(len(prompt_ids), req.max_new(), "messages")
        params = req.sampling(req.max_new(), req.logprobs_k())
        asked = requested_grammar(req)
        forced = tool_grammar(tools, mode, req.parallel_tool_calls is not False, self.tool_format)
        if forced is not None and asked is not None:
            raise APIError(400, f"tool_choice {mode} and {asked[1]} each constrain the answer: give one",
                           param="tool_choice")  # fmt: skip
        if forced is not None:
            params["grammar"] = await checked(GrammarSpec("structural_tag", forced), "tools")
        elif asked is not None:
            params["grammar"] = await checked(*asked)
        prompts = [(prompt_ids, "")]
        fmt = self.tool_format if tools else None
        return await self._run("chat", req, prompts, params, start, request, fmt)

    async def completions(self, request: Request) -> Response:
        start = time.perf_counter()
        self.check_auth(request)
        req = validate_body(CompletionRequest, await self.read_json(request))
        self.check_model(req.model)
        self._check_n(req.n * len(req.prompts()))
        prompts: list[tuple[list[int], str]] = []
        for p in req.prompts():
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
                if not p:
                    raise APIError(400, "prompt must not be empty", param="prompt")
                ids = await asyncio.to_thread(self.tokenizer.encode, p)
                text = p
            else:
                ids = list(p)
                if min(ids) < 0 or max(ids) >= self.info.vocab_size:
                    raise APIError(
                        400, f"prompt token ids must be in [0, {self.info.vocab_size})", param="prompt"
                    )
                text = (
                    self.tokenizer.decode(ids, skip_special_tokens=False)
                    if req.echo and self.tokenizer
                    else ""
                )
            self.check_length(len(ids), req.max_tokens, "prompt")
            prompts.append((ids, text if req.echo else ""))
        params = req.sampling(req.max_tokens, req.logprobs)
        asked = requested_grammar(req)
        if asked is not None:
            params["grammar"] = await checked(*asked)
        return await self._run("completion", req, prompts, params, start, request)

    def _check_n(self, n: int) -> None:
        if n > self.manifest.server.max_n:
            raise APIError(
                400, f"at most {self.manifest.server.max_n} choices per request (n times prompts)", param="n"
            )

    async def _run(
        self,
        kind: str,
        req: Any,
        prompts: list[tuple[list[int], str]],
        params: dict,
        start: float,
        request: Request,
        tool_format: str | None = None,
    ) -> Response:
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        name = self.info.served_name
        waited = await self.admission.acquire()  # errors are counted by status in access_log.py
        self.metrics.router_queue.labels(name).observe(waited)
        run = request.state.splitserve_run = _Run(self, kind, req, prompts, params, rid, start)
        run.tool_format = tool_format
        self.runs.add(run)
        released = False

        async def cleanup() -> None:  # idempotent: cancel what still runs, give the slot back
            nonlocal released
            self.runs.discard(run)
            await run.cancel()
            if not released:
                released = True
                self.admission.release()

        handed_over = False
        try:
            run.launch()
            first = await run.first()
            if req.stream:
                handed_over = True
                return _Stream(run.sse(first), cleanup, media_type="text/event-stream", headers=run.headers())
            body = await _unless_disconnected(request, run.collect(first))
            return JSONResponse(body, headers=run.headers())
        except APIError as exc:
            if exc.code in ("kv_transfer_failed", "kv_transfer_timeout", "kv_transport"):
                # NOTE: labelled with the manifest's backend: the error does not say which one failed
                self.metrics.kv_failures.labels(name, self.manifest.transport.backend, exc.code).inc()
            raise
        finally:
            if not handed_over:
                await cleanup()

    def cut_streams(self) -> int:
        """The drain deadline: every request still running ends now with a 503 (a stream with an SSE
        error event and [DONE], not cut mid-body); its workers' requests are aborted. -> how many."""
        cut = APIError(503, "the server is shutting down: this request outlived the drain timeout",
                       type="server_error", code="server_shutdown")  # fmt: skip
        for run in list(self.runs):
            run.queue.put_nowait(cut)
        return len(self.runs)

    # ---- routes ---------------------------------------------------------------------------------

    def models(self) -> dict:
        names = (self.info.served_name, *self.info.aliases)  # every served name, as vLLM lists them
        return {"object": "list", "data": [self.model_card(n) for n in names]}

    def model_card(self, name: str | None = None) -> dict:
        return {
            "id": name or self.info.served_name,
            "object": "model",
            "created": self.info.created,
            "owned_by": "splitserve",
            "root": self.info.root,
            "max_model_len": self.info.max_model_len,
        }

    def health(self) -> tuple[int, dict]:
        """Public: whether every pool has a ready worker, and each worker's state (no addresses)."""
        pools = {role: len(self.workers.ready(role)) for role in self.manifest.pools()}
        ok = all(n > 0 for n in pools.values()) and not self.admission.closed
        public = ("name", "role", "state", "restarts", "startup_s", "kv_backend")
        workers = [{**{k: w.get(k) for k in public}, "engine": (w.get("info") or {}).get("engine")}
                   for w in self.describe_workers()]  # fmt: skip
        body = {
            "status": "ok" if ok else "degraded",
            "mode": self.manifest.mode,
            "ready": pools,
            "workers": workers,
        }
        return (200 if ok else 503), body

    def deployment(self) -> dict:
        """Behind the API key: what `splitserve verify` needs (worker addresses, asked-for backends,
        thresholds)."""
        t = self.manifest.transport
        return {
            "mode": self.manifest.mode,
            "model": self.info.served_name,
            "transport": {
                "backend": t.backend,
                "required_backends": t.required(),
                "fallback": list(t.fallback),
            },
            "verify": self.manifest.verify.model_dump(),
            "workers": self.describe_workers(),
        }

    # ---- run-time signals -----------------------------------------------------------------------

    def on_probe(self, prefill: str, decode: str, result: dict | None, error: str | None) -> None:
        m, name = self.metrics, self.info.served_name
        if result is None:
            m.kv_probe_failures.labels(name, prefill, decode).inc()
            m.kv_bandwidth_low.labels(name, prefill, decode).set(1)
            return
        m.kv_probe_gbps.labels(name, prefill, decode, result["backend"]).set(result["gbps"])
        low = result["gbps"] < self.manifest.verify.min_gbps
        m.kv_bandwidth_low.labels(name, prefill, decode).set(1 if low else 0)
        if low:
            log.warning(
                "kv probe %s -> %s: %.3f GB/s over %s, below verify.min_gbps %.3f",
                prefill, decode, result["gbps"], result["backend"], self.manifest.verify.min_gbps,
            )  # fmt: skip

    def on_worker_event(self, kind: str, worker: Any) -> None:
        if kind == "died":
            self.metrics.worker_restarts.labels(self.info.served_name, worker.name, worker.role).inc()

    async def render_metrics(self) -> bytes:
        m, name = self.metrics, self.info.served_name
        m.router_running.labels(name).set(self.admission.running)
        for w in self.describe_workers():
            lab = (name, w["name"], w["role"])
            load = (w.get("info") or {}).get("load") or {}
            for stage, secs in {**load.get("seconds", {}), "total": load.get("total_seconds")}.items():
                if secs is not None:
                    m.load_seconds.labels(*lab, stage).set(secs)
            if load:
                status = (load.get("cache") or {}).get("status", "off")
                m.weight_cache.labels(*lab, status, load.get("method", "?")).set(1)
            if w.get("startup_s") is not None:
                m.startup_seconds.labels(*lab).set(w["startup_s"])
        m.router_waiting.labels(name).set(self.admission.waiting)
        m.prime_workers(self.describe_workers())
        if self.worker_stats is not None:
            m.from_worker_stats(await self.worker_stats(), self.manifest.transport.required())
        return m.render()


_DEADLINE = object()  # queued by a run's deadline timer


class _Run:
    """One API request's choices in flight: each runs in its own task and feeds one queue."""

    def __init__(
        self,
        server: OpenAIServer,
        kind: str,
        req: Any,
        prompts: list[tuple[list[int], str]],
        params: dict,
        rid: str,
        start: float,
    ) -> None:
        self.s, self.kind, self.req, self.params, self.rid, self.start = server, kind, req, params, rid, start
        self.created = int(time.time())
        self.deadline = start + server.manifest.router.timeouts.request_s
        self.choices: list[_Choice] = []
        self.echo: list[str] = []
        self.jobs: list[tuple[int, list[int], dict]] = []
        for p_idx, (ids, echo) in enumerate(prompts):
            for i in range(req.n):
                index = p_idx * req.n + i
                choice_params = dict(params)
                if params.get("seed") is not None:
                    choice_params["seed"] = params["seed"] + i  # as SamplingParams.for_child
                self.choices.append(_Choice(index, len(ids)))
                self.echo.append(echo)
                self.jobs.append((index, ids, choice_params))
        self.prompt_tokens = sum(len(ids) for ids, _ in prompts)
        self.queue: asyncio.Queue[Piece | BaseException | int | object] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.first_metrics: dict = {}
        self.ttft: float | None = None
        self.pending = len(self.jobs)
        self._timer: asyncio.TimerHandle | None = None
        self.tool_format: str | None = None  # tools on: each choice's text is parsed for calls

    def launch(self) -> None:
        for index, ids, params in self.jobs:
            rid = self.rid if len(self.jobs) == 1 else f"{self.rid}-{index}"
            self.tasks.append(asyncio.create_task(self._one(index, ids, params, rid)))
        # the whole request's deadline: one timer that queues a marker, not a `wait_for` per token
        # (which makes a task per call: ~20 us a token on the loop that writes every stream)
        left = max(self.deadline - time.perf_counter(), 0.0)
        self._timer = asyncio.get_running_loop().call_later(left, self.queue.put_nowait, _DEADLINE)

    async def _one(self, index: int, ids: list[int], params: dict, rid: str) -> None:
        try:
            async for piece in self.s.dispatcher.run(index, ids, params, rid):
                self.queue.put_nowait(piece)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            self.queue.put_nowait(exc)
        else:
            self.queue.put_nowait(index)

    async def cancel(self) -> None:
        if self._timer is not None:
            self._timer.cancel()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def next(self) -> Piece | None:
        """The next piece of any choice; None once all are done. Raises a choice's error."""
        while self.pending:
            item = await self.queue.get()
            if item is _DEADLINE:
                raise APIError(
                    504,
                    f"the request ran past its deadline ({self.s.manifest.router.timeouts.request_s:g}s)",
                    type="timeout",
                    code="request_timeout",
                )
            if isinstance(item, BaseException):
                raise (
                    item
                    if isinstance(item, APIError)
                    else APIError(500, f"internal error: {item!r}", type="server_error")
                )
            if isinstance(item, int):
                self.pending -= 1
                continue
            self._account(item)
            return item
        if self._timer is not None:
            self._timer.cancel()  # else it holds this run until the deadline
        return None

    def _account(self, piece: Piece) -> None:
        now = time.perf_counter()
        c = self.choices[piece.index]
        m, name = self.s.metrics, self.s.info.served_name
        if c.last_time == 0.0:
            ttft = now - self.start
            m.observe_first(ttft, piece.metrics)
            if self.ttft is None:
                self.ttft, self.first_metrics = ttft, piece.metrics
        elif piece.token_ids:
            gap = (now - c.last_time) / len(piece.token_ids)
            observe = self.s.itl.observe
            for _ in piece.token_ids:
                observe(gap)
        c.last_time = now
        c.tokens += len(piece.token_ids)
        self.s.generated.inc(len(piece.token_ids))
        if piece.finished:
            c.finish_reason = piece.finish_reason
            m.requests.labels(name, piece.finish_reason or "unknown").inc()

    async def first(self) -> Piece:
        piece = await self.next()
        assert piece is not None
        return piece

    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.rid, **ttft_breakdown(self.ttft or 0.0, self.first_metrics)}

    def usage(self) -> dict:
        done = sum(c.tokens for c in self.choices)
        return {
            "prompt_tokens": self.prompt_tokens,
            "completion_tokens": done,
            "total_tokens": self.prompt_tokens + done,
        }

    def _finish_metrics(self) -> None:
        m, name = self.s.metrics, self.s.info.served_name
        m.observe_done(time.perf_counter() - self.start, self.ttft, max(c.tokens for c in self.choices))
        m.prompt_tokens.labels(name).inc(self.prompt_tokens)

    # ---- non-streaming --------------------------------------------------------------------------

    async def collect(self, first: Piece) -> dict:
        piece: Piece | None = first
        try:
            while piece is not None:
                self._add(piece)
                piece = await self.next()
        except BaseException:
            await self.cancel()
            raise
        self._finish_metrics()
        choices = []
        for c, echo in zip(self.choices, self.echo, strict=True):
            lp = self._logprobs(c.logprobs) if self.params.get("logprobs") is not None else None
            if self.kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
                reason = c.finish_reason
                if self.tool_format is not None:
                    msg["content"], calls = ToolParser(self.tool_format).parse(c.text)
                    if calls:
                        msg["tool_calls"] = [call.to_openai() for call in calls]
                        reason = "tool_calls" if reason == "stop" else reason
                choices.append({"index": c.index, "message": msg, "logprobs": lp, "finish_reason": reason})
            else:
                choices.append(
                    {
                        "index": c.index,
                        "text": echo + c.text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason,
                    }
                )
        obj = "chat.completion" if self.kind == "chat" else "text_completion"
        return {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.s.info.served_name,
            "choices": choices,
            "usage": self.usage(),
        }

    def _add(self, piece: Piece) -> None:
        c = self.choices[piece.index]
        c.text += piece.text
        if piece.logprobs:
            c.logprobs.extend(piece.logprobs)

    # ---- logprobs -------------------------------------------------------------------------------

    def _logprobs(self, entries: list[dict], offset: int = 0) -> dict:
        tt = self.s.token_text
        if self.kind == "chat":
            content = []
            for e in entries:
                tok = tt(e["token_id"])
                top = [{"token": tt(t), "logprob": lp, "bytes": list(tt(t).encode())} for t, lp in e["top"]]
                content.append(
                    {"token": tok, "logprob": e["logprob"], "bytes": list(tok.encode()), "top_logprobs": top}
                )
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            offsets.append(offset)
            tok = tt(e["token_id"])
            tokens.append(tok)
            offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [e["logprob"] for e in entries],
            "top_logprobs": [{tt(t): lp for t, lp in e["top"]} for e in entries],
            "text_offset": offsets,
        }

    # ---- streaming ------------------------------------------------------------------------------

    async def sse(self, first: Piece) -> AsyncIterator[bytes]:
        include_usage = self.req.include_usage()
        continuous = bool(self.req.stream_options and self.req.stream_options.continuous_usage_stats)
        try:
            if self.kind == "chat":
                for c in self.choices:  # the role first, as OpenAI does
                    yield self._chunk(
                        [
                            {
                                "index": c.index,
                                "delta": {"role": "assistant", "content": ""},
                                "logprobs": None,
                                "finish_reason": None,
                            }
                        ],
                        continuous,
                    )
            piece: Piece | None = first
            offsets = [0] * len(self.choices)
            tools = [ToolDeltas(self.tool_format) for _ in self.choices] if self.tool_format else None
            while piece is not None:
                c = self.choices[piece.index]
                lp = None
                if self.params.get("logprobs") is not None:
                    lp = self._logprobs(piece.logprobs or [], offsets[piece.index])
                    offsets[piece.index] += sum(
                        len(self.s.token_text(e["token_id"])) for e in piece.logprobs or []
                    )
                text = piece.text
                if tools is not None:
                    for chunk in self._tool_chunks(tools[piece.index], piece, lp, continuous):
                        yield chunk
                    piece = await self.next()
                    continue
                if self.kind == "chat":
                    choice = {
                        "index": c.index,
                        "delta": {"content": text},
                        "logprobs": lp,
                        "finish_reason": c.finish_reason if piece.finished else None,
                    }
                else:
                    if c.tokens == len(piece.token_ids):  # this choice's first piece
                        text = self.echo[piece.index] + text
                    choice = {
                        "index": c.index,
                        "text": text,
                        "logprobs": lp,
                        "finish_reason": c.finish_reason if piece.finished else None,
                    }
                yield self._chunk([choice], continuous)
                piece = await self.next()
            self._finish_metrics()
            if include_usage:
                yield self._chunk([], False, usage=True)
        except APIError as exc:
            self.s.metrics.errors.labels(self.s.info.served_name, str(exc.status)).inc()
            yield _sse({**exc.body(), "status": exc.status})
        except asyncio.CancelledError:
            log.info("client went away from %s; aborting its choices", self.rid)
            raise
        yield b"data: [DONE]\n\n"

    def _tool_chunks(self, tools: ToolDeltas, piece: Piece, lp: dict | None, continuous: bool) -> list[bytes]:
        """A chat piece with tools on: a chunk per content run, call announced or arguments fragment;
        the finish on the last."""
        c = self.choices[piece.index]
        deltas = tools.deltas(piece.text, piece.finished) or ([{"content": ""}] if piece.finished else [])
        chunks = []
        for k, delta in enumerate(deltas):
            last = piece.finished and k == len(deltas) - 1
            reason = c.finish_reason if last else None
            if last and tools.calls and reason == "stop":
                reason = "tool_calls"
            choice = {"index": c.index, "delta": delta, "logprobs": lp if k == 0 else None,
                      "finish_reason": reason}  # fmt: skip
            chunks.append(self._chunk([choice], continuous))
        return chunks

    def _chunk(self, choices: list[dict], continuous: bool, usage: bool = False) -> bytes:
        obj = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body: dict[str, Any] = {
            "id": self.rid,
            "object": obj,
            "created": self.created,
            "model": self.s.info.served_name,
            "choices": choices,
        }
        if usage or continuous:
            body["usage"] = self.usage()
        return _sse(body)


class _Stream(StreamingResponse):
    """A streaming response that runs `cleanup` however it ends: finished, failed or the client gone
    (a generator never started, or left suspended at a yield, would otherwise run no `finally`)."""

    def __init__(
        self, content: AsyncIterator[bytes], cleanup: Callable[[], Awaitable[None]], **kw: Any
    ) -> None:
        super().__init__(content, **kw)
        self._cleanup = cleanup

    @property
    def cleanup(self) -> Callable[[], Awaitable[None]]:
        return self._cleanup

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._cleanup()


_encode = msgspec.json.Encoder().encode


def _sse(body: dict) -> bytes:
    return b"data: " + _encode(body) + b"\n\n"


async def _unless_disconnected(request: Request, work: Awaitable[dict]) -> dict:
    """Run `work`; if the client disconnects first, cancel it (its choices abort on the workers)."""
    task = asyncio.ensure_future(work)

    async def gone() -> None:
        while True:
            msg = await request.receive()
            if msg["type"] == "http.disconnect":
                return

    watcher = asyncio.create_task(gone())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
    if task not in done:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task
        raise APIError(499, "client closed the request", code="client_closed")
    return task.result()


def build_api(server: OpenAIServer, lifespan: Any = None) -> FastAPI:
    app = FastAPI(title="splitserve", lifespan=lifespan)
    install_routes(app, lambda: server)
    return app


def install_routes(app: FastAPI, get: Callable[[], OpenAIServer]) -> None:
    """The API's routes and error handlers on `app`, over the server `get()` returns (the Ray ingress
    builds its app at import time and its server later, in the replica)."""
    app.add_middleware(ContainErrors)  # inside the access log: a 500 answered here keeps the connection
    app.add_middleware(DocsGuard, get=get)  # /docs, /redoc, /openapi.json behind the API key
    app.add_middleware(AccessLog, get=get)  # the access log line, and errors counted by status

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        kind = "not_found" if exc.status_code == 404 else None
        return JSONResponse(
            APIError(exc.status_code, str(exc.detail), code=kind).body(), status_code=exc.status_code
        )

    @app.exception_handler(Exception)
    async def internal(request: Request, exc: Exception) -> JSONResponse:
        log.error("%s %s failed", request.method, request.url.path, exc_info=exc)
        body = APIError(500, f"internal error ({type(exc).__name__})", type="server_error").body()
        return JSONResponse(body, status_code=500)

    @app.get("/v1/models")
    async def models(request: Request) -> dict:
        get().check_auth(request)
        return get().models()

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str, request: Request) -> dict:
        get().check_auth(request)
        get().check_model(model_id)
        return get().model_card(model_id)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(request: Request) -> Response:
        return await get().chat(request)

    @app.post("/v1/completions", response_model=None)
    async def completions(request: Request) -> Response:
        return await get().completions(request)

    @app.post("/v1/responses", response_model=None)
    async def responses(request: Request) -> Response:
        return await get().responses(request)

    install_utility_routes(app, get)

    @app.get("/admin/deployment")
    async def deployment(request: Request) -> dict:
        get().check_auth(request)
        return get().deployment()

    @app.get("/health")
    async def health() -> JSONResponse:
        status, body = get().health()
        return JSONResponse(body, status_code=status)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        server = get()
        if server.manifest.server.metrics_auth:  # with API keys set, a key (or metrics_auth: false)
            server.check_auth(request)
        body = await server.metrics_cache.get()
        return Response(body, media_type="text/plain; version=0.0.4; charset=utf-8")


__all__ = ["Admission", "ModelInfo", "OpenAIServer", "build_api", "install_routes"]
