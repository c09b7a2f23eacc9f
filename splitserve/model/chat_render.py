"""A chat template rendered with jinja2 alone, as transformers' `apply_chat_template` renders it.

The router and the workers' front ends tokenize chats with the `tokenizers` library and this module,
so that they never import transformers (seconds of CPU at every start). What the template sees is
transformers' (`utils/chat_template_utils.py`): a sandboxed, immutable jinja2 environment with
`trim_blocks` and `lstrip_blocks`, loop controls, a `tojson` filter that does not escape HTML,
`raise_exception`, `strftime_now`, the tokenizer's special tokens (`bos_token`, `eos_token`, ...), the
messages (keys whose value is None dropped), `tools`, `documents`, `add_generation_prompt` and the
caller's variables; `continue_final_message` cuts the text where the final message ends. A template
that uses `{% generation %}` (assistant masks, for training) is left to transformers.
"""

from __future__ import annotations

import functools
import json
from datetime import datetime
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment

_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None,
            sort_keys: bool = False) -> str:  # fmt: skip
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


class _Namespace(jinja2.utils.Namespace):
    """jinja2's `namespace` without underscore-prefixed attributes (no reach into CPython internals)."""

    def __init__(*args: Any, **kwargs: Any) -> None:  # noqa: N805 - jinja2's own signature trick
        self, rest = args[0], args[1:]
        for name in dict(*rest, **kwargs):
            _Namespace._check(name)
        jinja2.utils.Namespace.__init__(self, dict(*rest, **kwargs))

    def __setitem__(self, name: str, value: Any) -> None:
        _Namespace._check(name)
        jinja2.utils.Namespace.__setitem__(self, name, value)

    @staticmethod
    def _check(name: object) -> None:
        if isinstance(name, str) and name.startswith("_"):
            raise jinja2.exceptions.SecurityError(f"a chat template may not set {name!r} on a namespace")


@functools.lru_cache(maxsize=16)
def compile_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals.update(raise_exception=_raise_exception, strftime_now=_strftime_now, namespace=_Namespace)
    env.globals["dict"] = dict
    return env.from_string(source)


def _plain(value: Any) -> Any:
    """JSON-typed copies of what the template sees (a fresh copy: the caller's messages stay as they are)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, dict):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_plain(v) for v in value]
    for base, plain in ((str, str.__str__), (int, int.__int__), (float, float.__float__)):
        if isinstance(value, base):  # a subclass (an enum, a numpy scalar) back to the plain type
            return plain(value)
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _aliased(message: dict[str, Any]) -> dict[str, Any]:
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return (
        message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}
    )


def render(
    source: str,
    messages: list[dict[str, Any]],
    special_tokens: dict[str, str],
    add_generation_prompt: bool = False,
    continue_final_message: bool = False,
    tools: list[dict[str, Any]] | None = None,
    documents: list[dict[str, Any]] | None = None,
    **kwargs: Any,
) -> str:
    """The chat's text from template `source`; a ValueError or jinja2 error when it does not render."""
    if not messages:
        raise ValueError("Cannot apply chat template to an empty conversation. Provide at least one message.")
    if continue_final_message and add_generation_prompt:
        raise ValueError("continue_final_message and add_generation_prompt are not compatible")
    chat = [_aliased({k: v for k, v in _plain(m).items() if v is not None}) for m in messages]
    final = None
    if continue_final_message:
        final = _mark_final(chat, source)
    variables = _plain({**special_tokens, **kwargs})
    template = compile_template(source)
    text = template.render(messages=chat, tools=_plain(tools), documents=_plain(documents),
                           add_generation_prompt=add_generation_prompt, **variables)  # fmt: skip
    if final is None:
        return text
    if final.strip() not in text or _CONTINUE_TAG.strip() not in text:
        raise ValueError("continue_final_message is set but the final message does not appear in the "
                         "chat after applying the chat template")  # fmt: skip
    at = text.rindex(_CONTINUE_TAG.strip())
    return text[:at] if text[at : at + len(_CONTINUE_TAG)] == _CONTINUE_TAG else text[:at].rstrip()


def _mark_final(chat: list[dict[str, Any]], source: str) -> str:
    """Tag the end of the final message's content (to cut the rendered text there); -> its text."""
    final = chat[-1].get("content")
    if final is None:
        raise ValueError('continue_final_message is set but the final message has no "content" to continue!')
    if "content" not in source:
        raise ValueError(
            'continue_final_message is set to "content" but the chat template does not read "content"'
        )
    if isinstance(final, list):
        for block in reversed(final):
            if "text" in block:
                text = block["text"]
                block["text"] = text + _CONTINUE_TAG
                return text
        raise ValueError(
            "continue_final_message is set but we could not find any text to continue in the final message!"
        )
    chat[-1]["content"] = final + _CONTINUE_TAG
    return final


__all__ = ["compile_template", "render"]
