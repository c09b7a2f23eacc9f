"""Tool calling in the router: the tools into the prompt, the grammar that forces a call, and the calls
parsed out of the model's text (whole, or as a stream goes by).

A chat request with `tools` passes here three times:
  1. `render_messages` gives the chat template the history (assistant `tool_calls`, `tool` results) and
     the tools. A template that knows tools (Qwen3's, Llama 3.1's) renders them its own way; one that
     does not (SmolLM2's) gets them as Hermes text: a `# Tools` system block, calls as `<tool_call>`
     blocks, results as `<tool_response>` blocks.
  2. `tool_grammar`: `tool_choice` "required" or a named function becomes a structural-tag grammar
     (xgrammar) that admits only calls of the right shape, in the model's own format (JSON, or
     Qwen3.5's XML parameters), arguments valid against the tool's parameters, so the call always
     parses; "auto" leaves the text free and "none" drops the tools.
  3. The calls are read out of the text by the parser of the model family (`parsers/`, chosen from the
     template or by `--tool-call-parser`): `hermes`, `llama3_json`, `qwen3_coder` (Qwen3.5's XML).
"""

from __future__ import annotations

import json
from typing import Any

from splitserve.router.openai_protocol import APIError
from splitserve.router.parsers import HERMES, LLAMA3, QWEN3_CODER, ToolCall, tool_parser_for_template

_HERMES_OPEN, _HERMES_CLOSE = "<tool_call>", "</tool_call>"


def parser_for(template: str | None) -> str:
    """The tool-call format of a chat template's model family."""
    return tool_parser_for_template(template)


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
        thought = m.reasoning_content or m.reasoning
        if native and thought and m.role == "assistant":  # a template that keeps earlier thinking
            msg["reasoning_content"] = thought
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
    from xgrammar.structural_tag import (
        GrammarFormat,
        JSONSchemaFormat,
        StructuralTag,
        TagFormat,
        TagsWithSeparatorFormat,
    )

    tags = []
    for i, t in enumerate(tools):
        fn = t["function"]
        arguments = _arguments_ebnf(fn.get("parameters"), f"tools[{i}].function.parameters")
        content: Any = GrammarFormat(grammar=arguments)
        if fmt == QWEN3_CODER:  # Qwen3.5's XML: each parameter a <parameter=NAME> block, typed by its schema
            begin, end = f"{_HERMES_OPEN}\n<function={fn['name']}>\n", f"</function>\n{_HERMES_CLOSE}"
            schema = {"additionalProperties": False, **(fn.get("parameters") or {"type": "object"})}
            # one blank at a time outside strings, as the template writes it (and the parser reads it)
            content = JSONSchemaFormat(json_schema=schema, style="qwen_xml", max_whitespace_cnt=1)
        elif fmt == LLAMA3:
            begin, end = f'{{"name": {json.dumps(fn["name"])}, "parameters": ', "}"
        else:
            begin = f'{_HERMES_OPEN}\n{{"name": {json.dumps(fn["name"])}, "arguments": '
            end = f"}}\n{_HERMES_CLOSE}"
        tags.append(TagFormat(begin=begin, content=content, end=end))
    sep = "; " if fmt == LLAMA3 else "\n"
    one = mode == "named" or not parallel
    body = TagsWithSeparatorFormat(tags=tags, separator=sep, at_least_one=True, stop_after_first=one)
    return StructuralTag(format=body).model_dump_json()


def _arguments_ebnf(params: dict | None, where: str) -> str:
    """The arguments' grammar: compact JSON valid against the parameters (strict, as for json_schema)."""
    import xgrammar as xgr

    from splitserve.sampling.grammar_check import clean_error

    schema = params or {"type": "object", "properties": {}}
    try:
        return str(xgr.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True))
    except Exception as exc:  # noqa: BLE001 - xgrammar's RuntimeError, with its words
        raise APIError(400, f"{where}: invalid JSON schema: {clean_error(exc)}", param=where) from None


__all__ = ["HERMES", "LLAMA3", "ToolCall", "chosen_tools", "parser_for", "render_messages",
           "template_knows_tools", "tool_grammar"]  # fmt: skip
