"""OpenAI request bodies (pydantic), their translation to worker sampling params, and API errors.

Fields we cannot honour are refused with a 400 that says so (logit_bias, legacy `functions`, suffix,
images); fields that change nothing here (user, metadata, store, service_tier) are accepted. vLLM's extra
sampling fields (top_k, min_p, repetition_penalty, min_tokens, ignore_eos, stop_token_ids,
skip_special_tokens, include_stop_str_in_output) are accepted as vLLM accepts them, and so are its
structured-output fields (structured.py turns them and `response_format` into a grammar) and tools
(tools.py).
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from splitserve.sampling.params import SamplingParams


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


_TYPE_TAGS = re.compile(r"^(str|int|float|bool|none|list|dict)$|\[")  # a union member's tag in a loc


def validate_body(model: type, body: dict) -> Any:
    """`model.model_validate(body)`, or a 400 naming the first problem's field in `param`, as OpenAI words
    it (the router's endpoints and its utility routes alike)."""
    try:
        return model.model_validate(body)
    except ValidationError as exc:
        errors = exc.errors()
        err = errors[0]
        param = ".".join(str(p) for p in err["loc"] if isinstance(p, int) or not _TYPE_TAGS.search(str(p)))
        msg = err["msg"].removeprefix("Value error, ")
        if err["type"] == "extra_forbidden":
            msg = "unrecognized request argument"
        if err["type"] == "missing":
            msg = "missing required field"
        more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
        raise APIError(400, f"{param}: {msg}{more}" if param else msg + more, param=param or None) from None


class _Req(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Req):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM: usage on every chunk
    include_obfuscation: bool | None = None  # accepted, nothing to obfuscate


class JSONSchemaFormat(_Req):
    """`response_format.json_schema`."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str = "response"
    description: str | None = None
    schema_: dict[str, Any] | bool | None = Field(default=None, alias="schema")
    strict: bool | None = None


class StructuredOutputs(_Req):
    """vLLM's `structured_outputs`: one of these."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    json_: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None


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
    # structured outputs (structured.py): OpenAI's response_format, vLLM's fields
    response_format: dict[str, Any] | None = None
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted; xgrammar here

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

    def sampling(
        self, max_tokens: int | None, logprobs: int | None, defaults: dict[str, Any] | None = None
    ) -> SamplingParams:
        """The worker's sampling params for one choice (n = 1; the router fans out n). `defaults`: the
        model's (its generation_config) for the sampling fields this request leaves unset. Values
        `SamplingParams` refuses are a 400."""
        defaults = defaults or {}
        out: dict[str, Any] = {
            "temperature": defaults.get("temperature", 1.0) if self.temperature is None else self.temperature,
            "top_p": defaults.get("top_p", 1.0) if self.top_p is None else self.top_p,
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
            value = getattr(self, key)
            if value is not None or key in defaults:
                out[key] = defaults[key] if value is None else value
        try:
            return SamplingParams(**out)
        except (TypeError, ValueError) as exc:
            raise APIError(400, str(exc)) from None


class TextPart(_Req):
    type: Literal["text"]
    text: str


class FunctionCall(_Req):
    name: str
    arguments: str  # JSON text


class ToolCallIn(_Req):
    """An assistant message's earlier call, as the client sends the history back."""

    id: str | None = None
    type: Literal["function"] = "function"
    function: FunctionCall


class FunctionDef(_Req):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_.\-]+$")
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolDef(_Req):
    type: Literal["function"]
    function: FunctionDef


class ChatMessage(_Req):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_call_id: str | None = None
    tool_calls: list[ToolCallIn] | None = None
    # an earlier answer's thinking, as this server returns it (vLLM's two names): a template that
    # keeps earlier thinking (Qwen3.5's, after the last user query) renders it
    reasoning_content: str | None = None
    reasoning: str | None = None
    # what an SDK's assistant message carries when a client appends it back as is: nothing to use
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: None = None
    function_call: None = None

    @model_validator(mode="after")
    def _content(self) -> ChatMessage:
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
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
    tools: list[ToolDef] | None = None
    tool_choice: Literal["none", "auto", "required"] | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    functions: list[Any] | None = None
    function_call: Any = None
    modalities: list[str] | None = None
    reasoning_effort: str | None = None  # onto the template's enable_thinking (thinking.py)
    # vLLM's chat extras
    thinking_token_budget: int | None = Field(default=None, ge=0)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _chat(self) -> ChatCompletionRequest:
        if self.functions or self.function_call is not None:
            raise ValueError("the legacy functions / function_call are not supported: use tools")
        if self.tool_choice not in (None, "none", "auto") and not self.tools:
            raise ValueError("tool_choice needs tools")
        if isinstance(self.tool_choice, dict) and not (
            self.tool_choice.get("type") == "function" and isinstance(self.tool_choice.get("function"), dict)
        ):
            raise ValueError('tool_choice must be "none", "auto", "required" or {"type": "function", '
                             '"function": {"name": ...}}')  # fmt: skip
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

    @field_validator("prompt", mode="wrap")
    @classmethod
    def _token_ids(cls, v: Any, handler: ValidatorFunctionWrapHandler) -> Any:
        """A list of plain ints (a token-id prompt, as JSON gives it) is the union's `list[int]` as it
        stands. The union would try `str` and `list[str]` first, the latter failing on every id (an
        error object per id), then copy the list."""
        if type(v) is list and v and set(map(type, v)) == {int}:
            return v
        return handler(v)

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
        if isinstance(p[0], int):  # one union member's output: all ints, or none (never empty)
            return [list(p)]  # type: ignore[arg-type]
        return list(p)  # type: ignore[arg-type]


__all__ = [
    "APIError",
    "ChatCompletionRequest",
    "ChatMessage",
    "CompletionRequest",
    "StreamOptions",
    "validate_body",
]
