"""OpenAI's Responses API (`POST /v1/responses`) over the chat path: text and function tools, streamed
and not. Stateless: nothing is stored, so `previous_response_id` is refused and `store` changes nothing.

A request's life: `ResponsesRequest` (pydantic) -> `to_chat()`, a chat completions body (`instructions`
as the system message; `input` items as messages: text, earlier `function_call`s as assistant tool
calls, `function_call_output`s as tool messages; `tools`, `tool_choice`, `text.format` as
`response_format`, `max_output_tokens`) -> the chat path (endpoints.py) -> its answer back as a `response`
object (`response_object`), or its SSE chunks as Responses events (`ResponseEvents`: created, the
output items with their text or argument deltas, completed).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import msgspec
from pydantic import Field, model_validator

from splitserve.router.openai_protocol import _Req


class ResponsesRequest(_Req):
    model: str
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: dict[str, Any] | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stream: bool = False
    store: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    previous_response_id: str | None = None
    reasoning: dict[str, Any] | None = None  # its `effort`: chat's reasoning_effort (router/thinking.py)
    truncation: Literal["disabled", "auto"] | None = None
    include: list[str] | None = None
    service_tier: str | None = None
    seed: int | None = None  # vLLM's extra
    thinking_token_budget: int | None = Field(default=None, ge=0)  # vLLM's extra (router/thinking.py)

    @model_validator(mode="after")
    def _supported(self) -> ResponsesRequest:
        if self.previous_response_id is not None:
            raise ValueError("previous_response_id needs stored responses, which this server does not keep")
        for t in self.tools or []:
            if t.get("type") != "function":
                raise ValueError(f"only function tools are supported, not {t.get('type')!r}")
        return self

    def to_chat(self) -> dict[str, Any]:
        """The equivalent chat completions body."""
        body: dict[str, Any] = {"model": self.model, "messages": self._messages(), "stream": self.stream}
        for key, value in (
            ("temperature", self.temperature),
            ("top_p", self.top_p),
            ("seed", self.seed),
            ("max_tokens", self.max_output_tokens),
            ("parallel_tool_calls", self.parallel_tool_calls),
            ("thinking_token_budget", self.thinking_token_budget),
        ):
            if value is not None:
                body[key] = value
        if self.tools:
            body["tools"] = [
                {
                    "type": "function",
                    "function": {
                        k: t[k]
                        for k in ("name", "description", "parameters", "strict")
                        if t.get(k) is not None
                    },
                }
                for t in self.tools
            ]
        choice = self.tool_choice
        if isinstance(choice, dict) and choice.get("type") == "function":
            choice = {"type": "function", "function": {"name": choice.get("name")}}
        if choice is not None:
            body["tool_choice"] = choice
        fmt = (self.text or {}).get("format")
        if fmt and fmt.get("type") == "json_schema":
            schema = {k: fmt[k] for k in ("name", "schema", "strict", "description") if k in fmt}
            body["response_format"] = {"type": "json_schema", "json_schema": schema}
        elif fmt:
            body["response_format"] = {"type": fmt.get("type")}
        if (self.reasoning or {}).get("effort") is not None:
            body["reasoning_effort"] = self.reasoning["effort"]  # type: ignore[index]
        if self.stream:
            body["stream_options"] = {"include_usage": True}
        return body

    def _messages(self) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        if self.instructions:
            out.append({"role": "system", "content": self.instructions})
        if isinstance(self.input, str):
            return [*out, {"role": "user", "content": self.input}]
        for item in self.input:
            kind = item.get("type", "message")
            if kind == "message":
                out.append({"role": item.get("role", "user"), "content": _text(item.get("content"))})
            elif kind == "function_call":
                call = {
                    "id": item.get("call_id"),
                    "type": "function",
                    "function": {"name": item.get("name"), "arguments": item.get("arguments", "{}")},
                }
                if out and out[-1]["role"] == "assistant" and out[-1].get("tool_calls") is not None:
                    out[-1]["tool_calls"].append(call)
                else:
                    out.append({"role": "assistant", "content": None, "tool_calls": [call]})
            elif kind == "function_call_output":
                output = item.get("output")
                text = output if isinstance(output, str) else json.dumps(output)
                out.append({"role": "tool", "tool_call_id": item.get("call_id"), "content": text})
            elif kind != "reasoning":
                out.append({"role": "user", "content": f"[unsupported input item {kind!r}]"})
        return out


def _text(content: Any) -> str:
    if isinstance(content, str):
        return content
    return "".join(p.get("text", "") for p in content or [] if isinstance(p, dict))


def _message_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    return {
        "type": "message",
        "id": item_id or f"msg_{uuid.uuid4().hex}",
        "status": status,
        "role": "assistant",
        "content": [{"type": "output_text", "text": text, "annotations": [], "logprobs": []}],
    }


def _reasoning_item(text: str, status: str = "completed", item_id: str | None = None) -> dict[str, Any]:
    """The model's thinking as an output item (the reasoning parser took it apart from the answer)."""
    return {"type": "reasoning", "id": item_id or f"rs_{uuid.uuid4().hex}", "status": status, "summary": [],
            "content": [{"type": "reasoning_text", "text": text}]}  # fmt: skip


def _call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    fn = call["function"]
    return {
        "type": "function_call",
        "id": f"fc_{uuid.uuid4().hex}",
        "call_id": call["id"],
        "name": fn["name"],
        "arguments": fn["arguments"],
        "status": status,
    }


def _envelope(
    req: ResponsesRequest,
    model: str,
    rid: str,
    status: str,
    output: list,
    usage: dict | None,
    reason: str | None = None,
) -> dict[str, Any]:
    fmt = (req.text or {}).get("format") or {"type": "text"}
    return {
        "id": rid,
        "object": "response",
        "created_at": int(time.time()),
        "status": status,
        "model": model,
        "output": output,
        "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if reason == "length" else None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "metadata": req.metadata or {},
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": req.tool_choice or "auto",
        "tools": [_tool_echo(t) for t in req.tools or []],
        "text": {"format": fmt},
        "truncation": req.truncation or "disabled",
        "store": False,
        "reasoning": None,
        **({"usage": usage} if usage is not None else {}),  # none while in progress
    }


def _tool_echo(tool: dict[str, Any]) -> dict[str, Any]:
    """A function tool as a response object lists it (every field present)."""
    keys = ("description", "parameters", "strict")
    return {"type": "function", "name": tool.get("name"), **{k: tool.get(k) for k in keys}}


def _usage(chat_usage: dict | None) -> dict | None:
    if not chat_usage:
        return None
    cached = (chat_usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
    return {
        "input_tokens": chat_usage["prompt_tokens"],
        "output_tokens": chat_usage["completion_tokens"],
        "total_tokens": chat_usage["total_tokens"],
        "input_tokens_details": {"cached_tokens": cached, "cache_write_tokens": 0},
        "output_tokens_details": {
            "reasoning_tokens": (chat_usage.get("completion_tokens_details") or {}).get("reasoning_tokens", 0)
        },
    }


def response_object(req: ResponsesRequest, model: str, chat: dict[str, Any]) -> dict[str, Any]:
    """A chat completion -> the `response` object."""
    choice = chat["choices"][0]
    msg = choice["message"]
    output = [_reasoning_item(msg["reasoning_content"])] if msg.get("reasoning_content") else []
    output += [_message_item(msg["content"])] if msg.get("content") else []
    output += [_call_item(c) for c in msg.get("tool_calls") or []]
    reason = choice["finish_reason"]
    status = "incomplete" if reason == "length" else "completed"
    rid = "resp_" + chat["id"].removeprefix("chatcmpl-")
    return _envelope(req, model, rid, status, output, _usage(chat.get("usage")), reason)


class ResponseEvents:
    """A streamed chat completion's SSE chunks -> the Responses API's events."""

    def __init__(self, req: ResponsesRequest, model: str, chat_id: str | None = None) -> None:
        self.req, self.model = req, model
        # the chat request's id as a response id (as the access log shows it), else a new one
        self.rid = "resp_" + (chat_id.removeprefix("chatcmpl-") if chat_id else uuid.uuid4().hex)
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.text: str | None = None  # the open message item's text, None while none is open
        self.call: int | None = None  # the output index of the function call being streamed
        self.thought: str | None = None  # the open reasoning item's text, None while none is open

    def _event(self, kind: str, **fields: Any) -> bytes:
        body = {"type": kind, "sequence_number": self.seq, **fields}
        self.seq += 1
        return b"event: " + kind.encode() + b"\ndata: " + msgspec.json.encode(body) + b"\n\n"

    async def sse(self, chunks: AsyncIterator[bytes]) -> AsyncIterator[bytes]:
        start = _envelope(self.req, self.model, self.rid, "in_progress", [], None)
        yield self._event("response.created", response=start)
        yield self._event("response.in_progress", response=start)
        usage, reason = None, None
        async for raw in chunks:
            data = raw.decode().removeprefix("data: ").strip()
            if data == "[DONE]":
                break
            body = json.loads(data)
            if "error" in body:
                yield self._event(
                    "error",
                    code=body["error"].get("code"),
                    message=body["error"]["message"],
                    param=body["error"].get("param"),
                )
                return
            usage = body.get("usage") or usage
            for choice in body.get("choices", []):
                for event in self._delta(choice.get("delta") or {}):
                    yield event
                reason = choice.get("finish_reason") or reason
        for event in self._close_thought() + self._close_text() + self._close_call():
            yield event
        status = "incomplete" if reason == "length" else "completed"
        final = _envelope(self.req, self.model, self.rid, status, self.output, _usage(usage), reason)
        yield self._event(
            "response.completed" if status == "completed" else "response.incomplete", response=final
        )

    def _delta(self, delta: dict[str, Any]) -> list[bytes]:
        events = self._thinking(delta["reasoning_content"]) if delta.get("reasoning_content") else []
        if delta.get("content") or delta.get("tool_calls"):
            events += self._close_thought()
        if delta.get("content"):
            events += self._close_call()
            if self.text is None:
                self.text = ""
                item = _message_item("", "in_progress")
                item["content"] = []
                self.output.append(item)
                events.append(
                    self._event("response.output_item.added", output_index=len(self.output) - 1, item=item)
                )
                events.append(
                    self._event(
                        "response.content_part.added",
                        item_id=item["id"],
                        output_index=len(self.output) - 1,
                        content_index=0,
                        part={"type": "output_text", "text": "", "annotations": [], "logprobs": []},
                    )
                )
            self.text += delta["content"]
            events.append(
                self._event(
                    "response.output_text.delta",
                    item_id=self.output[-1]["id"],
                    output_index=len(self.output) - 1,
                    content_index=0,
                    delta=delta["content"],
                    logprobs=[],
                )
            )
        for call in delta.get("tool_calls") or []:
            if "id" not in call:  # a fragment of the open call's arguments
                events += self._arguments(call["function"]["arguments"])
                continue
            events += self._close_text() + self._close_call()
            item = _call_item(call, "in_progress")
            self.output.append(item)
            self.call = len(self.output) - 1
            events.append(
                self._event(
                    "response.output_item.added", output_index=self.call, item={**item, "arguments": ""}
                )
            )
            item["arguments"] = ""
            events += self._arguments(call["function"]["arguments"])
        return events

    def _arguments(self, fragment: str) -> list[bytes]:
        if self.call is None or not fragment:
            return []
        item = self.output[self.call]
        item["arguments"] += fragment
        return [
            self._event(
                "response.function_call_arguments.delta",
                item_id=item["id"],
                output_index=self.call,
                delta=fragment,
            )
        ]

    def _close_call(self) -> list[bytes]:
        if self.call is None:
            return []
        index, self.call = self.call, None
        item = self.output[index]
        item["status"] = "completed"
        return [
            self._event(
                "response.function_call_arguments.done",
                item_id=item["id"],
                output_index=index,
                name=item["name"],
                arguments=item["arguments"],
            ),
            self._event("response.output_item.done", output_index=index, item=item),
        ]

    def _thinking(self, text: str) -> list[bytes]:
        events = []
        if self.thought is None:
            self.thought = ""
            self.output.append(_reasoning_item("", "in_progress"))
            events.append(self._event("response.output_item.added", output_index=len(self.output) - 1,
                                      item=self.output[-1]))  # fmt: skip
        self.thought += text
        where = {"item_id": self.output[-1]["id"], "output_index": len(self.output) - 1, "content_index": 0}
        return [*events, self._event("response.reasoning_text.delta", **where, delta=text)]

    def _close_thought(self) -> list[bytes]:
        if self.thought is None:
            return []
        index, text, self.thought = len(self.output) - 1, self.thought, None
        item = self.output[index] = _reasoning_item(text, "completed", self.output[index]["id"])
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [self._event("response.reasoning_text.done", **where, text=text),
                self._event("response.output_item.done", output_index=index, item=item)]  # fmt: skip

    def _close_text(self) -> list[bytes]:
        if self.text is None:
            return []
        index, text = len(self.output) - 1, self.text
        item = _message_item(text, "completed", self.output[index]["id"])
        self.output[index] = item
        self.text = None
        where = {"item_id": item["id"], "output_index": index, "content_index": 0}
        return [
            self._event("response.output_text.done", **where, text=text, logprobs=[]),
            self._event("response.content_part.done", **where, part=item["content"][0]),
            self._event("response.output_item.done", output_index=index, item=item),
        ]


__all__ = ["ResponseEvents", "ResponsesRequest", "response_object"]
