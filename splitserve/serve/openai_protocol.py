"""OpenAI request bodies (pydantic), their translation to worker sampling params, and API errors.

Fields we cannot honour are refused with a 400 that says so (tools, logit_bias, non-text response
formats, suffix, images); fields that change nothing here (user, metadata, store, service_tier) are
accepted. vLLM's extra sampling fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos,
stop_token_ids, skip_special_tokens, include_stop_str_in_output) are accepted as vLLM accepts them.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator


class APIError(Exception):
    """An error answered in OpenAI's format: {"error": {"message", "type", "param", "code"}}."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Req):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk
    include_obfuscation: bool | None = None  # accepted, nothing to obfuscate


class _Sampling(_Req):
    """The sampling fields the chat and completions APIs share."""

    model: str
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    n: int = Field(default=1, ge=1)
    max_tokens: int | None = Field(default=None, ge=1)
    stop: str | list[str] | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    seed: int | None = Field(default=None, ge=-(2**63), lt=2**64)
    presence_penalty: float = Field(default=0.0, ge=-2, le=2)
    frequency_penalty: float = Field(default=0.0, ge=-2, le=2)
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    # vLLM's extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    @field_validator("stop")
    @classmethod
    def _stops(cls, v: str | list[str] | None) -> str | list[str] | None:
        stops = [v] if isinstance(v, str) else (v or [])
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if len(stops) > 16:
            raise ValueError("at most 16 stop strings")
        return v

    @model_validator(mode="after")
    def _unsupported(self) -> _Sampling:
        if self.logit_bias:
            raise ValueError("logit_bias is not supported by this server")
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options is only allowed when stream is true")
        return self

    def stops(self) -> list[str]:
        return [self.stop] if isinstance(self.stop, str) else list(self.stop or [])

    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def sampling(self, max_tokens: int | None, logprobs: int | None) -> dict[str, Any]:
        """The worker's sampling params for one choice (n = 1; the router fans out n)."""
        out: dict[str, Any] = {
            "temperature": 1.0 if self.temperature is None else self.temperature,
            "top_p": 1.0 if self.top_p is None else self.top_p,
            "max_tokens": max_tokens,
            "stop": self.stops(),
            "seed": self.seed,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids or []),
            "skip_special_tokens": self.skip_special_tokens,
            "include_stop_str_in_output": self.include_stop_str_in_output,
            "logprobs": logprobs,
        }
        for key in ("top_k", "min_p", "repetition_penalty"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class TextPart(_Req):
    type: Literal["text"]
    text: str


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.content is None and self.role != "assistant":
            raise ValueError(f"a {self.role} message needs content")
        return self

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(p.text for p in self.content)


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    response_format: dict[str, Any] | None = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None
    # vLLM's chat extras
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.tools or self.functions:
            raise ValueError("tools and functions are not supported by this server")
        if self.tool_choice not in (None, "none"):
            raise ValueError("tool_choice is not supported by this server")
        fmt = (self.response_format or {}).get("type", "text")
        if fmt != "text":
            raise ValueError(f"response_format {fmt!r} is not supported by this server (only 'text')")
        if self.modalities and self.modalities != ["text"]:
            raise ValueError("only the 'text' modality is supported")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs to be true")
        if self.add_generation_prompt and self.continue_final_message:
            raise ValueError("add_generation_prompt and continue_final_message cannot both be true")
        return self

    def max_new(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def logprobs_k(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Sampling):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(default=16, ge=1)  # OpenAI's default for completions
    logprobs: int | None = Field(default=None, ge=0, le=20)
    echo: bool = False
    best_of: int | None = Field(default=None, ge=1)
    suffix: str | None = None

    @model_validator(mode="after")
    def _completion(self) -> CompletionRequest:
        if self.suffix:
            raise ValueError("suffix is not supported by this server")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of other than n is not supported by this server")
        if isinstance(self.prompt, list) and not self.prompt:
            raise ValueError("prompt must not be empty")
        if isinstance(self.prompt, list) and any(isinstance(p, list) and not p for p in self.prompt):
            raise ValueError("a token-id prompt must not be empty")
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs (prompt logprobs) is not supported by this server")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str):
            return [p]
        if all(isinstance(x, int) for x in p):
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


__all__ = ["APIError", "ChatCompletionRequest", "ChatMessage", "CompletionRequest", "StreamOptions"]
