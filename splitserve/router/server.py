"""The OpenAI-compatible HTTP API over the router: `OpenAIServer`, what every route shares (auth, the
body, the model and length checks, the admission queue, the deployment's health, models and metrics).

    routes.py       the routes and error handlers on the FastAPI app
    endpoints.py    chat / completions / responses: validate, render, tokenize, constrain
    respond.py      one request's answer: a slot in the queue, a Run, JSON or an SSE stream
    run.py          a Run: the request's choices through the Dispatcher, collected or as SSE frames
    utility_routes.py, admission.py, access_log.py, guard.py: the rest of the edge

A request's path through them: read the body (413 over `max_body_bytes`, 400 for bad JSON or UTF-8),
authenticate (401), validate (400, naming the field), check the model (404) and the context length
(400 with the numbers), tokenize, take a slot in the bounded queue (429 with Retry-After when it is
full, 503 when the wait runs past `queue_s`), then run every choice through the `Dispatcher`
concurrently. The answer starts only after the first piece of output has arrived, so a request that
fails before producing anything gets a real status; a failure after that is an SSE `error` event.
A client that goes away cancels its choices, which aborts them on the workers.
"""

from __future__ import annotations

import hmac
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from fastapi import Request
from starlette.requests import ClientDisconnect

from splitserve.config.manifest import Manifest
from splitserve.router.admission import Admission
from splitserve.router.dispatch import Dispatcher, WorkerSet
from splitserve.router.gate import Gate
from splitserve.router.guard import MetricsSnapshot
from splitserve.router.json_edge import parse_json
from splitserve.router.lenient import ignored_fields_counter
from splitserve.router.metrics import KV_FAILURE_KINDS, RouterMetrics
from splitserve.router.migrate import KV_FAULTS, migration_counter
from splitserve.router.openai_protocol import APIError
from splitserve.router.parsers import chosen_parsers
from splitserve.router.tools import template_knows_tools
from splitserve.router.vllm_metrics import VllmMetrics
from splitserve.wire.ops import ProbeResult
from splitserve.wire.role import RoleChangeRequest, RoleChangeResult
from splitserve.wire.stats import WorkerRow

log = logging.getLogger(__name__)


@dataclass
class ModelInfo:
    served_name: str
    max_model_len: int
    vocab_size: int
    root: str  # the checkpoint path
    created: int = field(default_factory=lambda: int(time.time()))
    aliases: tuple[str, ...] = ()  # more names a request may give (--served-model-name A B)
    # sampling defaults for the fields a request leaves unset (model/generation_defaults.py)
    generation_defaults: dict[str, float | int] = field(default_factory=dict)


class OpenAIServer:
    def __init__(
        self,
        manifest: Manifest,
        workers: WorkerSet,
        tokenizer: Any,
        info: ModelInfo,
        describe_workers: Callable[[], list[dict]] = list,
        worker_stats: Callable[[], Awaitable[list[WorkerRow]]] | None = None,
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
        self.grammar_limits = manifest.server.structured.limits()  # structured.py checks specs on them
        self.gate = Gate(self.keys, manifest.server.rate_limit)  # 401 and 429 before the body (gate.py)
        self.dispatcher = Dispatcher(
            workers, manifest.router, manifest.mode, manifest.engine.block_size, worker_headers
        )
        srv = manifest.server
        self.admission = Admission(
            srv.max_concurrent_requests, srv.max_queued_requests, manifest.router.timeouts.queue_s
        )
        self.metrics = RouterMetrics(info.served_name)
        self.dispatcher.on_migrated = self._migrated
        self.dispatcher.cache_metrics(self.metrics.registry, info.served_name)  # router.policy: cache_aware
        self._count_migration = migration_counter(self.metrics.registry, info.served_name)
        self.metrics.kv_min_gbps.labels(info.served_name).set(manifest.verify.min_gbps)
        self.metrics.prime(manifest.transport.backend)
        self.ignored_fields = ignored_fields_counter(self.metrics.registry)  # unknown request fields
        self.vllm = VllmMetrics(self.metrics.registry, info.served_name, info.max_model_len,
                                manifest.transport.backend)  # vLLM's names  # fmt: skip
        self.token_text = lru_cache(maxsize=65536)(self._token_text)
        template = getattr(tokenizer, "chat_template", None)  # not `.hf`: that loads transformers
        self.chat_template: str | None = template
        # the model family's tool-call syntax and thinking shape (parsers/): as configured, else read
        # off the template; one that does not fit the template stops the start with the right name
        self.tool_format, self.reasoning_format = chosen_parsers(
            srv.tool_call_parser, srv.reasoning_parser, template
        )
        self.native_tools = template_knows_tools(template)
        # the per-token metrics, bound to their labels once (a .labels() lookup per token adds up)
        self.metrics_cache = MetricsSnapshot(self.render_metrics)  # /metrics: a snapshot a second
        # api_run.Run: requests in flight (cut_streams ends them at the drain deadline)
        self.runs: set[Any] = set()
        self.itl = self.metrics.itl.labels(info.served_name)
        self.generated = self.metrics.generation_tokens.labels(info.served_name)
        # POST /admin/workers/{name}/role: the runtime's role change (runtime/role_switch.py), where its
        # runtime has one
        self.change_role: Callable[[str, RoleChangeRequest], Awaitable[RoleChangeResult]] | None = None

    def _migrated(self, cause: str) -> None:
        self._count_migration(cause)
        if cause in KV_FAULTS:  # a failed transfer is one, whether the client sees it or not
            backend = self.manifest.transport.backend
            self.metrics.kv_failures.labels(self.info.served_name, backend, cause).inc()

    def kv_failed(self, exc: APIError) -> None:
        """Count a KV transfer's failure that ends a choice, before its first token or after it (a first
        token sent ahead of the transfer: `router.first_token`)."""
        if exc.code in KV_FAILURE_KINDS:
            # NOTE: labelled with the manifest's backend: the error does not say which one failed
            backend, name = self.manifest.transport.backend, self.info.served_name
            self.metrics.kv_failures.labels(name, backend, exc.code).inc()
            self.vllm.kv_failed.labels(name, backend).inc()

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

    def on_probe(self, prefill: str, decode: str, result: ProbeResult | None, error: str | None) -> None:
        m, name = self.metrics, self.info.served_name
        if result is None:
            m.kv_probe_failures.labels(name, prefill, decode).inc()
            m.kv_bandwidth_low.labels(name, prefill, decode).set(1)
            return
        m.kv_probe_gbps.labels(name, prefill, decode, result.backend).set(result.gbps)
        low = result.gbps < self.manifest.verify.min_gbps
        m.kv_bandwidth_low.labels(name, prefill, decode).set(1 if low else 0)
        if low:
            log.warning(
                "kv probe %s -> %s: %.3f GB/s over %s, below verify.min_gbps %.3f",
                prefill, decode, result.gbps, result.backend, self.manifest.verify.min_gbps,
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
        stats = await self.worker_stats() if self.worker_stats is not None else []
        m.from_worker_stats(stats, self.manifest.transport.required())
        self.vllm.from_worker_stats(stats, self.admission.waiting)
        return m.render()


__all__ = ["Admission", "ModelInfo", "OpenAIServer"]
