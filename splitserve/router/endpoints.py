"""The generating routes: POST /v1/chat/completions, /v1/completions and /v1/responses.

Each reads and validates its body (openai_protocol.py), checks the model, the choices and the context
length, renders and tokenizes the prompt (chat_template.py, tools.py), sets the grammar when the answer is
constrained (structured.py, tools.py), then hands the prompts to `api_respond.respond`, which takes a slot in
the bounded queue and answers as JSON or as an SSE stream. /v1/responses is a chat request translated
both ways (responses.py).
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from splitserve.router.chat_template import render_chat, template_kwargs
from splitserve.router.lenient import validate_request
from splitserve.router.openai_protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
)
from splitserve.router.parsers import chat_outputs
from splitserve.router.respond import CleanupStream, respond
from splitserve.router.responses import ResponseEvents, ResponsesRequest, response_object
from splitserve.router.server import OpenAIServer
from splitserve.router.structured import check_tool_limits, checked, requested_grammar
from splitserve.router.thinking import apply_effort, thinking_counter, thinking_params
from splitserve.router.tools import chosen_tools, render_messages, tool_grammar
from splitserve.sampling.params import GrammarSpec

log = logging.getLogger(__name__)


async def chat(server: OpenAIServer, request: Request) -> Response:
    start = time.perf_counter()
    server.check_auth(request)
    return await chat_body(server, await server.read_json(request), request, start)


async def responses(server: OpenAIServer, request: Request) -> Response:
    """/v1/responses: translated to a chat request, its answer translated back (responses.py)."""
    start = time.perf_counter()
    server.check_auth(request)
    req = validate_request(server, ResponsesRequest, await server.read_json(request))
    answer = await chat_body(server, req.to_chat(), request, start)
    ours = {k: v for k, v in answer.headers.items() if k.startswith("x-")}  # the request id, TTFT parts
    if isinstance(answer, CleanupStream):
        events = ResponseEvents(req, server.info.served_name, ours.get("x-request-id")).sse(
            answer.body_iterator
        )
        return CleanupStream(events, answer.cleanup, media_type="text/event-stream", headers=ours)
    body = response_object(req, server.info.served_name, msgspec.json.decode(answer.body))
    return JSONResponse(body, headers=ours)


async def chat_body(server: OpenAIServer, body: dict, request: Request, start: float) -> Response:
    req = validate_request(server, ChatCompletionRequest, body)
    server.check_model(req.model)
    check_n(server, req.n)
    limits = server.grammar_limits
    asked = requested_grammar(req, limits)  # a costly grammar refused before the prompt is rendered
    if server.tokenizer is None:
        raise APIError(400, "this model has no tokenizer: use /v1/completions with token ids")
    offered = [t.model_dump(exclude_none=True) for t in req.tools or []]
    tools, mode = chosen_tools(offered, req.tool_choice)
    messages = render_messages(req.messages, tools, server.native_tools)
    kwargs = template_kwargs(req.chat_template_kwargs, server.manifest.server.trust_request_chat_template)
    apply_effort(req.reasoning_effort, kwargs, server.reasoning_format, server.chat_template)
    if tools and server.native_tools:
        kwargs["tools"] = tools
    prompt_ids = await render_chat(
        server.tokenizer, messages, req.add_generation_prompt, req.continue_final_message, kwargs
    )
    server.check_length(len(prompt_ids), req.max_new(), "messages")
    params = req.sampling(req.max_new(), req.logprobs_k(), server.info.generation_defaults)
    if tools and mode == "auto" and not server.manifest.server.enable_auto_tool_choice:
        raise APIError(400, 'tool_choice "auto" needs a server started with --enable-auto-tool-choice',
                       param="tool_choice")  # fmt: skip
    if mode in ("required", "named"):
        check_tool_limits(tools, limits)
    fmt = server.tool_format if tools else None
    forced = tool_grammar(tools, mode, req.parallel_tool_calls is not False, server.tool_format)
    # a forced call (tool_choice required or named) is the whole answer: its arguments follow the tool's
    # parameters, and a response_format (which shapes the message's content, as OpenAI defines it) has
    # no content left to shape; without a forced call, the response_format constrains the content
    if forced is not None:
        params["grammar"] = await checked(GrammarSpec("structural_tag", forced), "tools", limits)
    elif asked is not None:
        params["grammar"] = await checked(*asked, limits)
    prompts = [(prompt_ids, "")]
    reasoning = server.reasoning_format
    tail = server.tokenizer.decode(prompt_ids[-8:], skip_special_tokens=False) if reasoning else ""
    # the thinking free of the grammar, which holds the answer after it; a budget bounds it (thinking.py)
    thinking = thinking_params(
        server.tokenizer, reasoning, tail, "grammar" in params, req.thinking_token_budget
    )
    if thinking is not None:
        params["thinking"] = thinking
    output = chat_outputs(fmt, tools, reasoning, tail)
    counter = thinking_counter(server.tokenizer, reasoning, tail)
    return await respond(server, "chat", req, prompts, params, start, request, output, counter)


async def completions(server: OpenAIServer, request: Request) -> Response:
    start = time.perf_counter()
    server.check_auth(request)
    req = validate_request(server, CompletionRequest, await server.read_json(request))
    server.check_model(req.model)
    check_n(server, req.n * len(req.prompts()))
    prompts: list[tuple[list[int], str]] = []
    for p in req.prompts():
        if isinstance(p, str):
            if server.tokenizer is None:
                raise APIError(400, "this model has no tokenizer: send token ids", param="prompt")
            if not p:
                raise APIError(400, "prompt must not be empty", param="prompt")
            ids = await asyncio.to_thread(server.tokenizer.encode, p)
            text = p
        else:
            ids = list(p)
            if min(ids) < 0 or max(ids) >= server.info.vocab_size:
                raise APIError(
                    400, f"prompt token ids must be in [0, {server.info.vocab_size})", param="prompt"
                )
            text = (
                server.tokenizer.decode(ids, skip_special_tokens=False)
                if req.echo and server.tokenizer
                else ""
            )
        server.check_length(len(ids), req.max_tokens, "prompt")
        prompts.append((ids, text if req.echo else ""))
    params = req.sampling(req.max_tokens, req.logprobs, server.info.generation_defaults)
    asked = requested_grammar(req, server.grammar_limits)
    if asked is not None:
        params["grammar"] = await checked(*asked, server.grammar_limits)
    return await respond(server, "completion", req, prompts, params, start, request)


def check_n(server: OpenAIServer, n: int) -> None:
    if n > server.manifest.server.max_n:
        raise APIError(
            400, f"at most {server.manifest.server.max_n} choices per request (n times prompts)", param="n"
        )
