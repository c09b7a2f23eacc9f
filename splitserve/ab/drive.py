"""One process of the load client: drive a trace at one OpenAI-compatible endpoint, streaming, timing
every chunk.

Per request, as `vllm bench serve` measures it (its `async_request_openai_completions`):
    start    = perf_counter() just before the POST
    TTFT     = arrival of the first SSE chunk that carries a choice, minus start
    ITL      = the gaps between later chunks with a choice (one chunk may hold several tokens)
    latency  = the last chunk with a choice, minus start
    tokens   = `usage.completion_tokens` from the final chunk (`stream_options.include_usage`)
Connections are kept alive and reused, as vLLM's aiohttp session does: every response is read to its
end (past `[DONE]`), so its connection goes back to the pool for the next request. This matters for
TTFT, not only for connect costs: a server whose sockets leave Nagle's algorithm on holds the first
chunk after the response headers until the client ACKs them, and a client that sends its next request
at once on a reused connection delays that ACK (~40 ms on Linux); a fresh connection ACKs at once. A
client that abandons each stream at `[DONE]` (then a new connection per request) would not see that.
A request fails, by kind: `http_<status>`, `timeout`, `connect`, `stream_error` (an SSE error event),
`incomplete` (no chunk with a choice, or the stream ended without `[DONE]`), `protocol` (anything else).

Open loop: each request (each agent session's first turn) is sent at its arrival offset whatever is
still in flight; a session's later turns follow their previous turn after its think time.

Per chunk the client does as little as it can, so that one client process keeps up with thousands of
tokens/s: the body is read as raw bytes and split into lines by hand (no text decoding, no line decoder),
every line read in one network read gets that read's arrival time, and a token chunk is recognised by a
byte search (`_quick`), not a JSON parse; only a chunk that may carry usage or an error, or that the search
cannot be sure of, is parsed in full.

This module drives a trace on one event loop (`drive`); `splitserve.ab.client.run_trace` is the entry
point, which spreads a trace over processes (splitserve.ab.procs) when `ClientOptions.procs` > 1.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import httpx

from splitserve.ab.workload import BenchRequest

_HEADER_PREFIX = "x-splitserve-ttft-"


@dataclass
class RequestResult:
    index: int
    kind: str
    prompt_len: int
    output_len: int  # asked for
    session: int | None = None
    success: bool = False
    error_kind: str = ""
    error: str = ""
    start_s: float = 0.0  # send time from the run's start
    ttft_s: float = 0.0
    latency_s: float = 0.0
    itl_s: list[float] = field(default_factory=list)
    output_tokens: int = 0  # usage.completion_tokens (0: the server sent no usage)
    server_ms: dict[str, float] = field(default_factory=dict)  # x-splitserve-ttft-* headers
    kv_backend: str | None = None

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["itl_s"] = [round(x, 6) for x in self.itl_s]
        return d


@dataclass(frozen=True)
class ClientOptions:
    model: str
    endpoint: str = "/v1/completions"  # an OpenAI completions route (prompts are token ids or text)
    api_key: str | None = None
    temperature: float = 0.0
    ignore_eos: bool = True
    timeout_s: float = 600.0
    max_concurrency: int | None = None
    extra_body: dict | None = None  # more fields for every request body (as vLLM's --extra-body)
    procs: int | None = 1  # client processes (splitserve.ab.procs); None: enough for the load


def _payload(req: BenchRequest, opts: ClientOptions) -> dict:
    prompt = req.prompt if isinstance(req.prompt, str) else list(req.prompt)
    body = {
        "model": opts.model,
        "prompt": prompt,
        "max_tokens": req.output_len,
        "temperature": opts.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if opts.ignore_eos:
        body["ignore_eos"] = True
    if opts.extra_body:
        body.update(opts.extra_body)
    return body


def _has_token(choices: list) -> bool:
    return bool(choices)  # as vLLM: a choice counts even with empty text (e.g. a held-back byte)


# What a `data:` line holds, as far as the metrics care.
_EMPTY, _TOKEN, _DONE, _PARSE = 0, 1, 2, 3
# In JSON text every quote inside a string is escaped, so `"key"` followed by a colon is a key (of this
# object or a nested one); a token's text can never forge one. Nested keys that are token strings
# (logprobs' top_logprobs) can, so each pattern also wants the value's first character.
_CHOICES = re.compile(rb'"choices"\s*:\s*\[\s*(\S)')
_USAGE = re.compile(rb'"usage"\s*:\s*(\S)')


def _quick(data: bytes) -> int:
    """A chunk's kind without parsing it: _TOKEN (a choice, nothing else the client reads), _EMPTY (no
    choice, no usage), _DONE, or _PARSE (an error or usage may be in it, or the search is unsure)."""
    if data == b"[DONE]":
        return _DONE
    if b'"error"' in data:
        return _PARSE
    u = _USAGE.search(data)
    if u is not None and u.group(1) != b"n":  # usage other than null
        return _PARSE
    c = _CHOICES.search(data)
    if c is None:
        return _PARSE
    return _EMPTY if c.group(1) == b"]" else _TOKEN


async def send_one(
    client: httpx.AsyncClient, req: BenchRequest, opts: ClientOptions, run_start: float
) -> RequestResult:
    res = RequestResult(req.index, req.kind, req.prompt_len, req.output_len, req.session)
    st = time.perf_counter()
    res.start_s = st - run_start
    rd = _Reader(res, st)
    try:
        async with client.stream("POST", opts.endpoint, json=_payload(req, opts)) as resp:
            if resp.status_code != 200:
                body = (await resp.aread())[:300].decode(errors="replace")
                res.error_kind, res.error = f"http_{resp.status_code}", body
                return res
            _read_headers(res, resp.headers)
            tail = b""
            async for raw in resp.aiter_bytes():
                if rd.done:
                    continue  # read on to the end of the body: the connection is then reused
                if b"\n" not in raw:
                    tail += raw
                    continue
                lines = (tail + raw).split(b"\n") if tail else raw.split(b"\n")
                tail = lines.pop()
                if rd.feed(lines, time.perf_counter()):
                    return res  # an error event
            if tail and not rd.done and rd.feed([tail], time.perf_counter()):
                return res  # the last line had no newline (aiter_lines reads it too)
    except httpx.TimeoutException as exc:
        res.error_kind, res.error = "timeout", repr(exc)
        return res
    except httpx.ConnectError as exc:
        res.error_kind, res.error = "connect", repr(exc)
        return res
    except (httpx.HTTPError, json.JSONDecodeError, ValueError) as exc:
        res.error_kind, res.error = "protocol", repr(exc)[:300]
        return res
    if not rd.got_first or not rd.done:
        res.error_kind = "incomplete"
        res.error = "no chunk with a choice" if not rd.got_first else "the stream ended without [DONE]"
        return res
    res.success = True
    res.latency_s = rd.last - st
    return res


class _Reader:
    """One response's SSE lines as they come: every line of one network read arrives at that read's
    time; TTFT and ITL are taken from the chunks with a choice, as vLLM's client does."""

    __slots__ = ("res", "st", "last", "got_first", "done")

    def __init__(self, res: RequestResult, st: float) -> None:
        self.res, self.st, self.last = res, st, st
        self.got_first = self.done = False

    def feed(self, lines: list[bytes], now: float) -> bool:
        """Read complete lines; True for an error event (recorded in the result)."""
        for line in lines:
            if not line.startswith(b"data:"):
                continue
            data = line[5:].strip()
            kind = _quick(data)
            if kind == _PARSE:
                kind = _parse(self.res, data)
                if kind < 0:
                    return True
            if kind == _TOKEN:
                if not self.got_first:
                    self.got_first, self.res.ttft_s = True, now - self.st
                else:
                    self.res.itl_s.append(now - self.last)
                self.last = now
            elif kind == _DONE:
                self.done = True
                break
        return False


def _parse(res: RequestResult, data: bytes) -> int:
    """The full parse of a chunk (_quick could not tell): _TOKEN or _EMPTY, with usage read into `res`;
    -1 for an error event (recorded in `res`)."""
    obj = json.loads(data)
    if "error" in obj:
        err = obj["error"]
        res.error_kind = "stream_error"
        res.error = str(err.get("message", err) if isinstance(err, dict) else err)[:300]
        return -1
    if _has_token(obj.get("choices") or []):
        return _TOKEN
    if usage := obj.get("usage"):
        res.output_tokens = int(usage.get("completion_tokens") or 0)
        if usage.get("prompt_tokens"):
            res.prompt_len = int(usage["prompt_tokens"])
    return _EMPTY


def _read_headers(res: RequestResult, headers: httpx.Headers) -> None:
    for key, value in headers.items():
        if key.startswith(_HEADER_PREFIX) and key.endswith("-ms"):
            part = key[len(_HEADER_PREFIX) : -3] or "ttft"
            try:
                res.server_ms[part] = float(value)
            except ValueError:
                pass
    res.kv_backend = headers.get("x-splitserve-kv-backend")


def chains(trace: list[BenchRequest]) -> list[list[BenchRequest]]:
    """Independent requests alone; a session's turns in order."""
    chains: list[list[BenchRequest]] = []
    sessions: dict[int, list[BenchRequest]] = {}
    for r in trace:
        if r.session is None:
            chains.append([r])
        elif r.session in sessions:
            sessions[r.session].append(r)
        else:
            sessions[r.session] = [r]
            chains.append(sessions[r.session])
    return chains


async def drive(
    base_url: str,
    trace: list[BenchRequest],
    opts: ClientOptions,
    on_done: Callable[[RequestResult], None] | None = None,
    transport: httpx.AsyncBaseTransport | None = None,
    start_at: Callable[[], float] | None = None,
) -> tuple[list[RequestResult], float]:
    """run_trace in this process, on this event loop. `start_at`, called once the HTTP client is set
    up, gives the run's start as a perf_counter() reading (default: now); arrivals are offsets from it."""
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    timeout = httpx.Timeout(opts.timeout_s, connect=30.0)
    sem = asyncio.Semaphore(opts.max_concurrency) if opts.max_concurrency else None
    results: dict[int, RequestResult] = {}
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, limits=limits, timeout=timeout, transport=transport
    ) as client:
        start = start_at() if start_at is not None else time.perf_counter()

        async def one(req: BenchRequest) -> None:
            if sem is None:
                res = await send_one(client, req, opts, start)
            else:
                async with sem:
                    res = await send_one(client, req, opts, start)
            results[req.index] = res
            if on_done:
                on_done(res)

        async def chain(reqs: list[BenchRequest]) -> None:
            delay = start + reqs[0].arrival_s - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            for k, req in enumerate(reqs):
                if k and req.think_s > 0:
                    await asyncio.sleep(req.think_s)
                await one(req)

        await asyncio.gather(*(chain(c) for c in chains(trace)))
        duration = time.perf_counter() - start
    return [results[r.index] for r in trace], duration


__all__ = ["ClientOptions", "RequestResult", "chains", "drive", "send_one"]
