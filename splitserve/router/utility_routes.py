"""vLLM's utility routes on the router: `POST /tokenize`, `POST /detokenize` (behind the API key when
keys are set), `GET /version`, `GET|POST /ping` (open, like /health).

/tokenize takes a `prompt` (completions) or `messages` (chat, rendered by the chat template with
`add_generation_prompt`, `tools` as chat does) and answers {count, max_model_len, tokens, token_strs};
/detokenize takes `tokens` and answers {prompt}.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import Response
from pydantic import Field

import splitserve
from splitserve.router.chat_template import render_chat
from splitserve.router.lenient import validate_request
from splitserve.router.openai_protocol import APIError, ChatMessage, ToolDef, _Req
from splitserve.router.tools import render_messages


class TokenizeRequest(_Req):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDef] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    return_token_strs: bool = False


class DetokenizeRequest(_Req):
    model: str | None = None
    tokens: list[int] = Field(max_length=1_000_000)


def install_utility_routes(app: FastAPI, get: Any) -> None:
    """`get()` -> the OpenAIServer (server.py) whose tokenizer, model info and keys these use."""

    @app.post("/tokenize")
    async def tokenize(request: Request) -> dict:
        server = get()
        server.check_auth(request)
        req = validate_request(server, TokenizeRequest, await server.read_json(request))
        if req.model is not None:
            server.check_model(req.model)
        tok = _tokenizer(server)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "give exactly one of prompt and messages")
        if req.prompt is not None:
            ids = await asyncio.to_thread(tok.encode, req.prompt, req.add_special_tokens)
        else:
            tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
            messages = render_messages(req.messages, tools, server.native_tools)
            kw: dict[str, Any] = {"tools": tools} if tools and server.native_tools else {}
            ids = await render_chat(tok, messages, req.add_generation_prompt, req.continue_final_message, kw)
        strs = [tok.token_text(t) for t in ids] if req.return_token_strs else None
        return {
            "count": len(ids),
            "max_model_len": server.info.max_model_len,
            "tokens": ids,
            "token_strs": strs,
        }

    @app.post("/detokenize")
    async def detokenize(request: Request) -> dict:
        server = get()
        server.check_auth(request)
        req = validate_request(server, DetokenizeRequest, await server.read_json(request))
        if req.model is not None:
            server.check_model(req.model)
        if req.tokens and (min(req.tokens) < 0 or max(req.tokens) >= server.info.vocab_size):
            raise APIError(400, f"tokens must be in [0, {server.info.vocab_size})", param="tokens")
        text = await asyncio.to_thread(_tokenizer(server).decode, req.tokens, False)
        return {"prompt": text}

    @app.get("/version")
    async def version() -> dict:
        return {"version": splitserve.__version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        return Response(status_code=200)


def _tokenizer(server: Any) -> Any:
    if server.tokenizer is None:
        raise APIError(400, "this model has no tokenizer")
    return server.tokenizer


__all__ = ["DetokenizeRequest", "TokenizeRequest", "install_utility_routes"]
