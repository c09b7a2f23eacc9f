"""Tool calling in the router: the tools into the prompt, the grammar that forces a call, and the calls
parsed out of the model's text (whole, or as a stream goes by).

A chat request with `tools` passes here three times:
  1. `render_messages` gives the chat template the history (assistant `tool_calls`, `tool` results) and
     the tools. A template that knows tools (Qwen3's, Llama 3.1's) renders them its own way; one that
     does not (SmolLM2's) gets them as Hermes text: a `# Tools` system block, calls as `<tool_call>`
     blocks, results as `<tool_response>` blocks.
  2. `tool_grammar`: `tool_choice` "required" or a named function becomes a structural-tag grammar
     (xgrammar) that admits only calls of the right shape, arguments valid against the tool's
     parameters, so the call always parses; "auto" leaves the text free and "none" drops the tools.
  3. `ToolParser` reads the calls out of the text, per model family: `hermes` (`<tool_call>{"name",
     "arguments"}</tool_call>`, Qwen and SmolLM2-style chatml) or `llama3_json` (`{"name",
     "parameters"}`, `;`-separated, an optional `<|python_tag|>`); `feed` does it for a stream, holding
     back text that may be the start of a call, and hands out each call once it is whole.
Streamed, `ToolDeltas` sends the calls as OpenAI does: a Hermes call is announced (id, type, name, empty
arguments) as soon as its name is whole, then its arguments follow in fragments as the model writes
them; the fragments join to the same `arguments` text the call has unstreamed. Llama 3 JSON calls
(whose end is known only at the end of the answer) come whole, one delta each.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from splitserve.router.openai_protocol import APIError

HERMES, LLAMA3 = "hermes", "llama3_json"
_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"
_PYTHON_TAG = "<|python_tag|>"
# a Hermes block's head once its name is whole and an object of arguments has begun
_HERMES_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*(?=\{)')


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: _new_call_id())

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {"id": self.id, "type": "function",
                               "function": {"name": self.name, "arguments": self.arguments}}  # fmt: skip
        if index is not None:
            out["index"] = index
        return out


def parser_for(template: str | None) -> str:
    """The tool-call format of a chat template's model family."""
    text = template or ""
    return LLAMA3 if ("<|python_tag|>" in text or "ipython" in text) else HERMES


def template_knows_tools(template: str | None) -> bool:
    return "tools" in (template or "")


# ---- the prompt --------------------------------------------------------------------------------------


def render_messages(messages: list[Any], tools: list[dict] | None, native: bool) -> list[dict[str, Any]]:
    """The chat history as the template takes it. `native`: the template renders tools itself;
    otherwise they are written into the text, Hermes style."""
    out: list[dict[str, Any]] = []
    for m in messages:
        msg: dict[str, Any] = {"role": m.role, "content": m.text()}
        if m.name:
            msg["name"] = m.name
        calls = [(c.function.name, c.function.arguments) for c in (m.tool_calls or [])]
        if native:
            if calls:
                msg["tool_calls"] = [{"type": "function", "function": {"name": n, "arguments": _obj(a)}}
                                     for n, a in calls]  # fmt: skip
            if m.tool_call_id:
                msg["tool_call_id"] = m.tool_call_id
        else:
            if calls:
                blocks = [f'{_HERMES_OPEN}\n{{"name": {json.dumps(n)}, "arguments": {a}}}\n{_HERMES_CLOSE}'
                          for n, a in calls]  # fmt: skip
                msg["content"] = "\n".join(filter(None, [msg["content"], *blocks]))
            if m.role == "tool":
                msg["content"] = f"<tool_response>\n{msg['content']}\n</tool_response>"
        out.append(msg)
    if tools and not native:
        block = _hermes_tools_block(tools)
        if out and out[0]["role"] in ("system", "developer"):
            out[0] = {**out[0], "content": f"{out[0]['content']}\n\n{block}"}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out


def _obj(arguments: str) -> Any:
    try:
        return json.loads(arguments)
    except ValueError:
        return arguments


def _hermes_tools_block(tools: list[dict]) -> str:
    lines = "\n".join(json.dumps(t, ensure_ascii=False) for t in tools)
    return (
        "# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
        f"You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{lines}\n"
        "</tools>\n\nFor each function call, return a json object with function name and arguments "
        "within <tool_call></tool_call> XML tags:\n<tool_call>\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    )


# ---- the grammar ---------------------------------------------------------------------------------


def chosen_tools(tools: list[dict], tool_choice: Any) -> tuple[list[dict], str]:
    """-> (the tools the model may call, "auto" | "none" | "required" | "named")."""
    if tool_choice is None or tool_choice in ("auto", "none", "required"):
        return (tools, tool_choice or "auto") if tool_choice != "none" else ([], "none")
    name = (tool_choice.get("function") or {}).get("name") if isinstance(tool_choice, dict) else None
    match = [t for t in tools if t["function"]["name"] == name]
    if not match:
        raise APIError(400, f"tool_choice names the function {name!r}, which is not among the tools",
                       param="tool_choice")  # fmt: skip
    return match, "named"


def tool_grammar(tools: list[dict], mode: str, parallel: bool, fmt: str) -> str | None:
    """xgrammar structural-tag JSON admitting only calls of `tools` ("required", "named"), else None."""
    if mode not in ("required", "named"):
        return None
    from xgrammar.structural_tag import GrammarFormat, StructuralTag, TagFormat, TagsWithSeparatorFormat

    tags = []
    for i, t in enumerate(tools):
        fn = t["function"]
        if fmt == LLAMA3:
            begin, end = f'{{"name": {json.dumps(fn["name"])}, "parameters": ', "}"
        else:
            begin = f'{_HERMES_OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": '
            end = f"}}\n{_HERMES_CLOSE}"
        content = GrammarFormat(
            grammar=_arguments_ebnf(fn.get("parameters"), f"tools[{i}].function.parameters")
        )
        tags.append(TagFormat(begin=begin, content=content, end=end))
    sep = "; " if fmt == LLAMA3 else "\n"
    one = mode == "named" or not parallel
    body = TagsWithSeparatorFormat(tags=tags, separator=sep, at_least_one=True, stop_after_first=one)
    return StructuralTag(format=body).model_dump_json()


def _arguments_ebnf(params: dict | None, where: str) -> str:
    """The arguments' grammar: compact JSON valid against the parameters (strict, as for json_schema)."""
    import xgrammar as xgr

    from splitserve.engine.grammar import clean_error

    schema = params or {"type": "object", "properties": {}}
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    except Exception as exc:  # noqa: BLE001 - xgrammar's RuntimeError, with its words
        raise APIError(400, f"{where}: invalid JSON schema: {clean_error(exc)}", param=where) from None


# ---- the calls in the text ---------------------------------------------------------------------------


class ToolParser:
    """Calls out of the model's text. `parse(text)` for a whole answer; `feed(delta)` for a stream:
    -> (content to send now, calls completed now); `finish()` at the end -> (the rest, its calls)."""

    def __init__(self, fmt: str) -> None:
        self.fmt = fmt
        self._buf = ""  # text not yet handed out
        self._in_calls = False  # llama3_json: the answer is calls from its start
        self._after_call = False  # hermes: a block just closed (a newline after it is dropped)
        self._block_id: str | None = None  # hermes: the id of the call whose block is open
        self._block_head: tuple[str, int] | None = None  # its name, where its arguments begin in the block

    def parse(self, text: str) -> tuple[str | None, list[ToolCall]]:
        content, calls = self.feed(text)
        rest, more = self.finish()
        content = (content + rest).strip()
        return (content or None), calls + more

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self._buf += delta
        if self.fmt == LLAMA3:
            return self._feed_llama()
        return self._feed_hermes()

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self.fmt == LLAMA3 and self._in_calls:
            calls = _llama_calls(rest)
            return ("", calls) if calls is not None else (rest, [])
        if _HERMES_OPEN in rest:  # an unclosed block (cut by max_tokens): try it whole
            head, _, body = rest.partition(_HERMES_OPEN)
            call = _hermes_call(body, self._take_block_id())
            return (head, [call]) if call is not None else (rest, [])
        return rest, []

    def open_call(self) -> tuple[str, str, str] | None:
        """The Hermes call being written, once its name is whole: -> (its id, its name, the text of its
        arguments so far, less a tail that may yet turn out to close the block); None otherwise."""
        if self.fmt != HERMES or not self._buf.startswith(_HERMES_OPEN):
            return None
        body = self._buf[len(_HERMES_OPEN) :]
        if self._block_head is None:  # matched once a block: its text before the arguments is fixed
            head = _HERMES_HEAD.match(body)
            if head is None:
                return None
            self._block_head = (_json_string(head.group(1)), head.end())
            self._block_id = self._block_id or _new_call_id()
        name, start = self._block_head
        assert self._block_id is not None  # set with the head, cleared with it (_take_block_id)
        rest = body[start:]
        return self._block_id, name, _arguments_part(rest[: len(rest) - _partial_suffix(rest, _HERMES_CLOSE)])

    def _take_block_id(self) -> str:
        block_id, self._block_id, self._block_head = self._block_id or _new_call_id(), None, None
        return block_id

    def _feed_hermes(self) -> tuple[str, list[ToolCall]]:
        out, calls = "", []
        while True:
            if self._after_call and self._buf:  # the newline between two blocks is no content
                self._buf = self._buf.lstrip("\n")
                self._after_call = not self._buf
            start = self._buf.find(_HERMES_OPEN)
            if start == -1:
                keep = _partial_suffix(self._buf, _HERMES_OPEN)
                out += self._buf[: len(self._buf) - keep]
                self._buf = self._buf[len(self._buf) - keep :]
                return out, calls
            out += self._buf[:start]
            end = self._buf.find(_HERMES_CLOSE, start)
            if end == -1:
                self._buf = self._buf[start:]
                return out, calls
            call = _hermes_call(self._buf[start + len(_HERMES_OPEN) : end], self._take_block_id())
            if call is not None:
                calls.append(call)
            else:  # not a call after all: it is text
                out += self._buf[start : end + len(_HERMES_CLOSE)]
            self._buf = self._buf[end + len(_HERMES_CLOSE) :]
            self._after_call = call is not None

    def _feed_llama(self) -> tuple[str, list[ToolCall]]:
        if not self._in_calls:
            head = self._buf.lstrip()
            if not head or _PYTHON_TAG.startswith(head[: len(_PYTHON_TAG)]) and len(head) < len(_PYTHON_TAG):
                return "", []  # undecided yet
            if head.startswith(("{", _PYTHON_TAG)):
                self._in_calls = True
                return "", []
            out, self._buf = self._buf, ""
            return out, []
        return "", []  # calls are handed out whole at the end


def _partial_suffix(text: str, tag: str) -> int:
    """How many trailing characters of `text` could begin `tag`."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if tag.startswith(text[-n:]):
            return n
    return 0


def _new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _json_string(escaped: str) -> str:
    try:
        return json.loads(f'"{escaped}"')
    except ValueError:
        return escaped


def _arguments_part(text: str) -> str:
    """The arguments' text out of what follows `"arguments":`, less the closing brace of the call's
    object and the white space around it (which a stream holds back until the block closes)."""
    text = text.rstrip()
    return text[:-1].rstrip() if text.endswith("}") else text


def _hermes_call(body: str, call_id: str) -> ToolCall | None:
    try:
        obj = json.loads(body.strip())
    except ValueError:
        return None
    call = _call_of(obj, "arguments", call_id)
    head = _HERMES_HEAD.match(body)
    if call is not None and head is not None:  # the model's own text of the arguments, as streamed
        raw = _arguments_part(body[head.end() :])
        try:
            if json.loads(raw) == obj.get("arguments"):
                return ToolCall(call.name, raw, call_id)
        except ValueError:
            pass
    return call


def _call_of(obj: Any, key: str, call_id: str | None = None) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get(key, obj.get("arguments", {}))
    if isinstance(args, str):
        args = _obj(args)
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False), call_id or _new_call_id())


def _llama_calls(text: str) -> list[ToolCall] | None:
    text = text.strip().removeprefix(_PYTHON_TAG).strip()
    decoder, calls, i = json.JSONDecoder(), [], 0
    while i < len(text):
        try:
            obj, i = decoder.raw_decode(text, i)
        except ValueError:
            return None
        call = _call_of(obj, "parameters")
        if call is None:
            return None
        calls.append(call)
        while i < len(text) and text[i] in " ;\n":
            i += 1
    return calls or None


class ToolDeltas:
    """One streamed choice's chat deltas when tools are on: content as it comes (less what may open a
    call); a call announced once its name is whole (id, type, name, arguments "") and its arguments in
    fragments after it, or (Llama 3 JSON) whole in one delta; numbered by `index` as OpenAI does."""

    def __init__(self, fmt: str) -> None:
        self.parser = ToolParser(fmt)
        self.calls = 0
        self._open: tuple[str, int] | None = None  # the announced call: (its id, its index)
        self._sent = ""  # the announced call's arguments sent so far

    def deltas(self, text: str, finished: bool) -> list[dict[str, Any]]:
        content, calls = self.parser.feed(text)
        if finished:
            rest, more = self.parser.finish()
            content, calls = content + rest, calls + more
        out: list[dict[str, Any]] = [{"content": content}] if content else []
        for call in calls:
            if self._open is not None and call.id == self._open[0]:
                if call.arguments.startswith(self._sent) and len(call.arguments) > len(self._sent):
                    out.append(self._fragment(self._open[1], call.arguments[len(self._sent) :]))
                self._open = None
                continue
            out.append({"tool_calls": [call.to_openai(self.calls)]})
            self.calls += 1
        writing = None if finished else self.parser.open_call()
        if writing is not None:
            call_id, name, arguments = writing
            if self._open is None or self._open[0] != call_id:
                self._open, self._sent = (call_id, self.calls), ""
                out.append({"tool_calls": [ToolCall(name, "", call_id).to_openai(self.calls)]})
                self.calls += 1
            if len(arguments) > len(self._sent) and arguments.startswith(self._sent):
                out.append(self._fragment(self._open[1], arguments[len(self._sent) :]))
                self._sent = arguments
        return out

    @staticmethod
    def _fragment(index: int, arguments: str) -> dict[str, Any]:
        return {"tool_calls": [{"index": index, "function": {"arguments": arguments}}]}


__all__ = ["HERMES", "LLAMA3", "ToolCall", "ToolDeltas", "ToolParser", "chosen_tools", "parser_for",
           "render_messages", "template_knows_tools", "tool_grammar"]  # fmt: skip
