"""One API request's choices in flight (`Run`): each runs through the `Dispatcher` in its own task and
feeds one queue; the run collects them into one JSON body (`Run.collect`) or writes them as SSE frames
(`Run.sse`), counting tokens, TTFT and ITL. A failure after the first piece is an SSE `error` event.
respond.py starts a run and answers with it.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from splitserve.router.dispatch import Piece
from splitserve.router.metrics import ttft_breakdown
from splitserve.router.openai_protocol import APIError
from splitserve.router.usage import ChoiceTally, usage
from splitserve.router.vllm_metrics import RunFigures
from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams

if TYPE_CHECKING:
    from splitserve.router.parsers import ChatOutput
    from splitserve.router.server import OpenAIServer
    from splitserve.router.thinking import ThinkingTokens

log = logging.getLogger(__name__)


_DEADLINE = object()  # queued by a run's deadline timer


class Run:
    """One API request's choices in flight: each runs in its own task and feeds one queue."""

    def __init__(
        self,
        server: OpenAIServer,
        kind: str,
        req: Any,
        prompts: list[tuple[list[int], str]],
        params: SamplingParams,
        rid: str,
        start: float,
    ) -> None:
        self.s, self.kind, self.req, self.params, self.rid, self.start = server, kind, req, params, rid, start
        self.created = int(time.time())
        self.deadline = start + server.manifest.router.timeouts.request_s
        self.choices: list[ChoiceTally] = []
        self.echo: list[str] = []
        self.jobs: list[tuple[int, list[int], SamplingParams]] = []
        for p_idx, (ids, echo) in enumerate(prompts):
            for i in range(req.n):
                index = p_idx * req.n + i
                choice_params = params.for_child(i)  # a distinct seed per choice
                self.choices.append(ChoiceTally(index, len(ids), p_idx))
                self.echo.append(echo)
                self.jobs.append((index, ids, choice_params))
        self.prompt_tokens = sum(len(ids) for ids, _ in prompts)
        self.queue: asyncio.Queue[Piece | BaseException | int | object] = asyncio.Queue()
        self.tasks: list[asyncio.Task] = []
        self.first_metrics: dict = {}
        self.ttft: float | None = None
        self.pending = len(self.jobs)
        self._timer: asyncio.TimerHandle | None = None
        # tools or thinking on: each choice's text parsed (parsers/output.py), one parser per choice
        self.output: Callable[[], ChatOutput] | None = None
        self.cancelling = False  # set by cancel(): its choices' cancellations are its own
        self._handed: Piece | None = None  # the piece next() returned last

    def count_thinking(self, counter: Callable[[], ThinkingTokens] | None) -> None:
        """Count each choice's thinking tokens (usage's reasoning_tokens) with a fresh `counter()`."""
        for c in self.choices:
            c.thinking = counter() if counter is not None else None

    def launch(self) -> None:
        for index, ids, params in self.jobs:
            rid = self.rid if len(self.jobs) == 1 else f"{self.rid}-{index}"
            self.tasks.append(asyncio.create_task(self._one(index, ids, params, rid)))
        # the whole request's deadline: one timer that queues a marker, not a `wait_for` per token
        # (which makes a task per call: ~20 us a token on the loop that writes every stream)
        left = max(self.deadline - time.perf_counter(), 0.0)
        self._timer = asyncio.get_running_loop().call_later(left, self.queue.put_nowait, _DEADLINE)

    async def _one(self, index: int, ids: list[int], params: SamplingParams, rid: str) -> None:
        end: BaseException | int | None = index  # what the consumer hears last from this choice
        try:
            stream = bool(self.req.stream)  # streamed: the first token may go ahead (router.first_token)
            # paced: this task queues each piece and goes on at once; next() tells when one is written
            pieces = self.s.dispatcher.run(index, ids, params, rid, self.deadline, stream, paced=True)
            async for piece in pieces:
                self.queue.put_nowait(piece)
        except Exception as exc:  # noqa: BLE001 - handed to the consumer
            end = exc
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if self.cancelling or (task is not None and task.cancelling()):
                end = None  # Run.cancel's own: the consumer has gone
                raise
            # a stray one from below (an awaited future that another task cancelled): the consumer hears it
            # now as a 500, not at the request's deadline
            log.warning("request %s: choice %d was cancelled inside the router", rid, index)
            end = APIError(
                500,
                f"choice {index} was cancelled inside the router",
                type="server_error",
                code="choice_cancelled",
            )
        except BaseException:
            end = None  # the process is going down
            raise
        finally:
            if end is not None:
                self.queue.put_nowait(end)

    async def cancel(self) -> None:
        self.cancelling = True
        if self._timer is not None:
            self._timer.cancel()
        for t in self.tasks:
            t.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)

    async def next(self) -> Piece | None:
        """The next piece of any choice; None once all are done. Raises a choice's error."""
        if self._handed is not None and self._handed.taken is not None:
            self._handed.taken.set()  # asked for the next: the last one is out (first_token.py)
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
            self._handed = item
            return item
        if self._timer is not None:
            self._timer.cancel()  # else it holds this run until the deadline
        return None

    def _account(self, piece: Piece) -> None:
        now = time.perf_counter()
        c = self.choices[piece.index]
        m, name = self.s.metrics, self.s.info.served_name
        if c.last_time == 0.0:
            c.cached = piece.metrics.get("cached_tokens") or 0  # the first piece carries the timings
            ttft = now - self.start
            m.observe_first(ttft, piece.metrics)
            self.s.vllm.observe_first(ttft, piece.metrics)
            if self.ttft is None:
                self.ttft, self.first_metrics = ttft, piece.metrics
        elif piece.metrics:  # a KV transfer after the first token (router.first_token), or a migration's
            m.observe_transfer(piece.metrics)
            self.s.vllm.observe_transfer(piece.metrics)
        if c.last_time and piece.token_ids:
            gap = (now - c.last_time) / len(piece.token_ids)
            observe, observe_vllm = self.s.itl.observe, self.s.vllm.itl_bound.observe
            for _ in piece.token_ids:
                observe(gap)
                observe_vllm(gap)
        if piece.token_ids or not c.last_time:  # an emptied piece (first_token.py) is no token's time
            c.last_time = now
        c.tokens += len(piece.token_ids)
        if c.thinking is not None:
            c.thinking.feed(piece.token_ids)
        self.s.generated.inc(len(piece.token_ids))
        if piece.finished:
            c.finish_reason = piece.finish_reason
            m.requests.labels(name, piece.finish_reason or "unknown").inc()
            self.s.vllm.success.labels(name, piece.finish_reason or "unknown").inc()

    async def first(self) -> Piece:
        piece = await self.next()
        assert piece is not None
        return piece

    def headers(self) -> dict[str, str]:
        return {"x-request-id": self.rid, **ttft_breakdown(self.ttft or 0.0, self.first_metrics)}

    def usage(self) -> dict:
        return usage(self.choices, self.prompt_tokens)

    def _finish_metrics(self) -> None:
        m, name = self.s.metrics, self.s.info.served_name
        e2e = time.perf_counter() - self.start
        m.observe_done(e2e, self.ttft, max(c.tokens for c in self.choices))
        m.prompt_tokens.labels(name).inc(self.prompt_tokens)
        self.s.vllm.observe_done(self._figures(e2e))

    def _figures(self, e2e: float) -> RunFigures:
        tokens = [c.tokens for c in self.choices]
        asked, first = self.params.max_tokens, self.first_metrics
        if asked is None:  # as vLLM counts it: what the context leaves
            asked = self.s.info.max_model_len - max(c.prompt_len for c in self.choices)
        return RunFigures(
            e2e, self.ttft, first.get("queue_s"), first.get("prefill_s"), self.prompt_tokens, sum(tokens),
            max(tokens), self.req.n, asked,
        )  # fmt: skip

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
            lp = self._logprobs(c.logprobs) if self.params.logprobs is not None else None
            if self.kind == "chat":
                msg: dict[str, Any] = {"role": "assistant", "content": c.text, "refusal": None}
                reason = c.finish_reason
                if self.output is not None:
                    parsed = self.output().parse(c.text)
                    msg.update(parsed.message_fields())
                    reason = "tool_calls" if parsed.calls and reason == "stop" else reason
                choices.append({"index": c.index, "message": msg, "logprobs": lp, "finish_reason": reason})
            else:
                choices.append({"index": c.index, "text": echo + c.text, "logprobs": lp,
                                "finish_reason": c.finish_reason})  # fmt: skip
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

    def _logprobs(self, entries: list[TokenLogprob], offset: int = 0) -> dict:
        tt = self.s.token_text
        if self.kind == "chat":
            content = []
            for e in entries:
                tok = tt(e.token_id)
                top = [{"token": tt(t), "logprob": lp, "bytes": list(tt(t).encode())} for t, lp in e.top]
                content.append(
                    {"token": tok, "logprob": e.logprob, "bytes": list(tok.encode()), "top_logprobs": top}
                )
            return {"content": content, "refusal": None}
        tokens, offsets = [], []
        for e in entries:
            offsets.append(offset)
            tok = tt(e.token_id)
            tokens.append(tok)
            offset += len(tok)
        return {
            "tokens": tokens,
            "token_logprobs": [e.logprob for e in entries],
            "top_logprobs": [{tt(t): lp for t, lp in e.top} for e in entries],
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
            tools = [self.output() for _ in self.choices] if self.output is not None else None
            while piece is not None:
                if not (piece.token_ids or piece.text or piece.finished):  # a KV transfer's figures alone
                    piece = await self.next()
                    continue
                c = self.choices[piece.index]
                lp = None
                if self.params.logprobs is not None:
                    lp = self._logprobs(piece.logprobs or [], offsets[piece.index])
                    offsets[piece.index] += sum(
                        len(self.s.token_text(e.token_id)) for e in piece.logprobs or []
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
            self.s.kv_failed(exc)
            yield sse_frame({**exc.body(), "status": exc.status})
        except asyncio.CancelledError:
            log.info("client went away from %s; aborting its choices", self.rid)
            raise
        yield b"data: [DONE]\n\n"

    def _tool_chunks(self, tools: ChatOutput, piece: Piece, lp: dict | None, continuous: bool) -> list[bytes]:
        """A chat piece with tools or thinking on: a chunk per run of reasoning or content, call announced
        or arguments fragment; the finish on the last."""
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
        return sse_frame(body)


_encode = msgspec.json.Encoder().encode


def sse_frame(body: dict) -> bytes:
    return b"data: " + _encode(body) + b"\n\n"
