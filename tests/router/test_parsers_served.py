"""The parsers in a served deployment: a random-weight tiny Qwen3.5 whose tokenizer carries Qwen3.5's own
chat template (tests/fixtures/qwen3_5), served colocated. The parsers come from the template
(`qwen3_coder`, `qwen3`); a parser that does not fit it stops the start, naming the one that does.
Random weights write no meaningful calls, so what is checked is what the parsers guarantee: the thinking
apart from the answer, streamed as unstreamed, and a forced call that parses and validates."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from serve_harness import manifest_yaml, start_deployment
from tiny_configs import TINY_QWEN3_5

from splitserve.config.manifest import parse_manifest
from splitserve.runtime.process import start_serve

TEMPLATE = Path(__file__).parents[1] / "fixtures" / "qwen3_5" / "chat_template.jinja"
CITY, DAYS = {"type": "string", "maxLength": 12}, {"type": "integer"}
PARAMS = {"type": "object", "required": ["city", "days"], "additionalProperties": False,
          "properties": {"city": CITY, "days": DAYS}}  # fmt: skip
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": PARAMS}}]
ASK = [{"role": "user", "content": "Weather in Paris for two days?"}]


@pytest.fixture(scope="module")
def qwen_dir(tmp_path_factory) -> Path:
    """A tiny Qwen3.5 checkpoint (the default model's vocabulary, so its tokenizer fits) with Qwen3.5's
    template, as a real checkpoint ships it."""
    import torch
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from splitserve.model.tokenizer import load_tokenizer

    path = tmp_path_factory.mktemp("qwen3_5-template")
    tok = load_tokenizer(None)
    assert tok is not None
    tok.hf.chat_template = TEMPLATE.read_text()
    tok.hf.save_pretrained(str(path))
    torch.manual_seed(1)
    config = Qwen3_5TextConfig(
        **{**TINY_QWEN3_5, "vocab_size": tok.vocab_size, "max_position_embeddings": 2048}
    )
    Qwen3_5ForCausalLM(config).eval().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def served(qwen_dir):
    dep = start_deployment(
        manifest_yaml(mode="colocated", model={"source": str(qwen_dir), "max_model_len": 2048})
    )
    yield dep
    assert dep.stop() == 0, "\n".join(dep.log)


def test_thinking_apart_streamed_as_unstreamed(served):
    client = served.client(timeout=120)
    kw = {
        "model": served.client().models.list().data[0].id,
        "messages": ASK,
        "temperature": 0,
        "max_tokens": 12,
    }
    whole = client.chat.completions.create(**kw).choices[0]
    msg = whole.message.model_dump()
    # the template opened <think>: a short random answer never closes it, so it is all reasoning
    assert (
        msg["reasoning_content"] and msg["reasoning"] == msg["reasoning_content"] and msg["content"] is None
    )
    reasoning, content = "", ""
    for chunk in client.chat.completions.create(**kw, stream=True):
        for choice in chunk.choices:
            delta = choice.delta.model_dump()
            reasoning += delta.get("reasoning_content") or ""
            content += delta.get("content") or ""
    assert (reasoning, content or None) == (msg["reasoning_content"], msg["content"])
    off = client.chat.completions.create(
        **kw, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    off_msg = off.choices[0].message.model_dump()
    assert off_msg["content"] and not off_msg.get("reasoning_content")  # the template closed the block


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_parses_and_validates(served, stream):
    """tool_choice required: Qwen3.5's XML held to the schema by the grammar, read by the XML parser,
    over several sampled answers (seeds), with no XML left in content."""
    client = served.client(timeout=120)
    model = client.models.list().data[0].id
    for seed in range(4):
        kw = {"model": model, "messages": ASK, "tools": TOOLS, "tool_choice": "required", "temperature": 1.0,
              "seed": seed, "max_tokens": 200, "parallel_tool_calls": False}  # fmt: skip
        if not stream:
            choice = client.chat.completions.create(**kw).choices[0]
            assert choice.finish_reason == "tool_calls" and not choice.message.content, choice
            (call,) = choice.message.tool_calls
            name, arguments = call.function.name, call.function.arguments
        else:
            name, arguments, content = "", "", ""
            for chunk in client.chat.completions.create(**kw, stream=True):
                for choice in chunk.choices:
                    content += choice.delta.content or ""
                    for tc in choice.delta.tool_calls or []:
                        name += tc.function.name or ""
                        arguments += tc.function.arguments or ""
            assert not content.strip()
        assert name == "get_weather" and "<parameter=" not in arguments, arguments
        jsonschema.validate(json.loads(arguments), PARAMS)


def test_a_parser_that_does_not_fit_the_template_is_refused_at_start(qwen_dir):
    manifest = manifest_yaml(mode="colocated", model={"source": str(qwen_dir), "max_model_len": 2048},
                             server={"port": 0, "tool_call_parser": "hermes"})  # fmt: skip
    with pytest.raises(RuntimeError, match="use --tool-call-parser qwen3_coder"):
        start_serve(parse_manifest(json.dumps(manifest), "test manifest"), timeout_s=180)


def test_responses_give_reasoning_items(served):
    client = served.client(timeout=120)
    kw = {
        "model": client.models.list().data[0].id,
        "input": "Weather?",
        "temperature": 0,
        "max_output_tokens": 12,
    }
    whole = client.responses.create(**kw).model_dump()
    (item,) = [i for i in whole["output"] if i["type"] == "reasoning"]
    text = item["content"][0]["text"]
    assert text and item["content"][0]["type"] == "reasoning_text"
    events = list(client.responses.create(**kw, stream=True))
    deltas = "".join(e.delta for e in events if e.type == "response.reasoning_text.delta")
    final = events[-1].response.model_dump()
    streamed = [i for i in final["output"] if i["type"] == "reasoning"]
    assert deltas == text and streamed[0]["content"][0]["text"] == text
