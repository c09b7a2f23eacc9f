"""What a request may pass to the chat template (`chat_template_kwargs`, vLLM's extra).

The server's own template is trusted; a request's is not (a client's `chat_template` in its
kwargs could replace the server's, and six looping templates took an ordinary request from 0.21 s to
26 s). So, as vLLM's `--trust-request-chat-template` does, a request may not bring a template unless
the manifest says `server.trust_request_chat_template: true`; nor may it set what the server decides
(tokenization, the messages, the generation prompt: those have their own request fields). The other
kwargs (e.g. Qwen3's `enable_thinking`) are the template's variables: JSON scalars, bounded in size.
Rendering runs off the event loop and is bounded in time (`TEMPLATE_TIMEOUT_S`).
"""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

from splitserve.router.openai_protocol import APIError

TEMPLATE_TIMEOUT_S = 5.0
MAX_KWARGS_BYTES = 4096
_SERVER_OWNS = {"tokenize", "return_dict", "return_tensors", "tokenizer", "conversation", "messages",
                "add_generation_prompt", "continue_final_message", "padding", "truncation", "max_length",
                "return_assistant_tokens_mask", "tools", "documents"}  # fmt: skip


def use_chat_template(tokenizer: Any, template: str | None) -> None:
    """vLLM's --chat-template (`model.chat_template`): the server's template from a file, or the Jinja
    text given, in place of the checkpoint's."""
    if template is None:
        return
    path = Path(template).expanduser()
    if path.is_file():
        template = path.read_text()
    elif "{{" not in template and "{%" not in template:
        raise ValueError(f"model.chat_template {template!r}: no such file, and not a Jinja template")
    if tokenizer is None:
        raise ValueError("model.chat_template: this model's tokenizer takes no chat template")
    tokenizer.set_chat_template(template)


def template_kwargs(kwargs: dict[str, Any] | None, trust_template: bool) -> dict[str, Any]:
    """`chat_template_kwargs` as the template may get them, or a 400 that names the key."""
    kwargs = dict(kwargs or {})
    if "chat_template" in kwargs and not trust_template:
        raise APIError(
            400,
            "chat_template_kwargs.chat_template: this server does not take chat templates from requests "
            "(server.trust_request_chat_template is false)",
            param="chat_template_kwargs",
        )
    owned = sorted(set(kwargs) & _SERVER_OWNS)
    if owned:
        raise APIError(400, f"chat_template_kwargs may not set {owned}: the server sets those",
                       param="chat_template_kwargs")  # fmt: skip
    if len(json.dumps(kwargs)) > MAX_KWARGS_BYTES:
        raise APIError(
            400, f"chat_template_kwargs is over {MAX_KWARGS_BYTES} bytes", param="chat_template_kwargs"
        )
    return kwargs


async def render_chat(
    tokenizer: Any,
    messages: list[dict[str, Any]],
    add_generation_prompt: bool,
    continue_final_message: bool,
    kwargs: dict[str, Any],
) -> list[int]:
    """The prompt's token ids from the chat template: off the event loop (HF renders in jinja's
    immutable sandbox) and bounded by TEMPLATE_TIMEOUT_S; a template that fails or runs long is a 400."""
    render = asyncio.to_thread(
        tokenizer.apply_chat_template,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=continue_final_message,
        **kwargs,
    )
    try:
        return await asyncio.wait_for(render, TEMPLATE_TIMEOUT_S)
    except TimeoutError:
        raise APIError(
            400, f"the chat template took longer than {TEMPLATE_TIMEOUT_S:g} s", param="messages"
        ) from None
    except Exception as exc:  # noqa: BLE001 - the template's own complaint, e.g. role order
        raise APIError(400, f"the chat template rejected these messages: {exc}", param="messages") from None


__all__ = ["MAX_KWARGS_BYTES", "TEMPLATE_TIMEOUT_S", "render_chat", "template_kwargs"]
