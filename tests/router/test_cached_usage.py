"""The prompt tokens a prefix cache served reach the client as OpenAI reports them: chat and text
completions' `usage.prompt_tokens_details.cached_tokens` (whole answers and a stream's usage chunk) and the
Responses API's `usage.input_tokens_details.cached_tokens`, read through the `openai` client's typed objects
from real deployments of the default model, colocated and disaggregated (where the figure is the prefill
worker's). A long prompt sent twice finds nothing cached the first time, then its whole blocks."""

from __future__ import annotations

import json
import uuid

import httpx
import pytest
from serve_harness import MODEL, check_schema, sse_events

pytestmark = pytest.mark.slow

BLOCK = 16  # the deployments' block size (the engine's default)
# about 300 tokens of the default model's vocabulary: twenty whole blocks and more
TEXT = " ".join(f"Item {i}: the river runs past the mill and the old stone bridge." for i in range(20))


@pytest.fixture(params=["colocated", "disaggregated"])
def dep(request):
    return request.getfixturevalue(request.param)


def _fresh() -> str:
    """A prefix no earlier request of the session shares, so the first send finds no block cached."""
    return f"Request {uuid.uuid4().hex}. "


def _check_hit(cached: int, prompt_tokens: int) -> None:
    assert 0 < cached <= prompt_tokens and cached % BLOCK == 0, (cached, prompt_tokens)
    assert cached >= prompt_tokens - 2 * BLOCK  # the whole prompt but its last, partial blocks


def _messages(prefix: str) -> list[dict[str, str]]:
    # the system message opens the prompt (the template's default one would be shared by every request)
    return [{"role": "system", "content": prefix + TEXT}, {"role": "user", "content": "Summarize."}]


def test_chat_whole_then_cached(dep, openai_schema):
    client, messages = dep.client(), _messages(_fresh())
    first = client.chat.completions.create(model=MODEL, messages=messages, max_tokens=4, temperature=0)
    assert first.usage.prompt_tokens > 10 * BLOCK
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    raw = httpx.post(
        f"{dep.url}/v1/chat/completions",
        json={"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0},
        headers=dep.headers(),
        timeout=60,
    ).json()
    check_schema(openai_schema, "CreateChatCompletionResponse", raw)
    assert raw["usage"]["prompt_tokens"] == first.usage.prompt_tokens
    _check_hit(raw["usage"]["prompt_tokens_details"]["cached_tokens"], first.usage.prompt_tokens)


def test_chat_stream_usage_chunk_then_cached(dep):
    client, messages = dep.client(), _messages(_fresh())
    figures = []
    for _ in range(2):
        chunks = list(
            client.chat.completions.create(
                model=MODEL,
                messages=messages,
                max_tokens=4,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )  # fmt: skip
        )
        usage = chunks[-1].usage
        assert chunks[-1].choices == [] and usage is not None
        figures.append((usage.prompt_tokens_details.cached_tokens, usage.prompt_tokens))
    assert figures[0][0] == 0
    _check_hit(*figures[1])


def test_completions_count_each_prompt_once(dep):
    """Two prompts, two choices each: the figure is the sum over the prompts, each counted once, as
    `prompt_tokens` counts it; it equals what each prompt finds cached when sent alone."""
    client = dep.client()
    prompts = [_fresh() + TEXT, _fresh() + TEXT]
    kw = {"model": MODEL, "max_tokens": 3, "temperature": 0}
    cold = client.completions.create(prompt=prompts, n=2, **kw)
    assert len(cold.choices) == 4 and cold.usage.prompt_tokens_details.cached_tokens == 0
    warm = client.completions.create(prompt=prompts, n=2, **kw)
    alone = [client.completions.create(prompt=p, **kw).usage for p in prompts]
    for u in alone:
        _check_hit(u.prompt_tokens_details.cached_tokens, u.prompt_tokens)
    assert warm.usage.prompt_tokens == cold.usage.prompt_tokens == sum(u.prompt_tokens for u in alone)
    assert warm.usage.prompt_tokens_details.cached_tokens == sum(
        u.prompt_tokens_details.cached_tokens for u in alone
    )
    # streamed: the usage chunk carries the same figure
    body = {**kw, "prompt": prompts, "n": 2, "stream": True, "stream_options": {"include_usage": True}}
    raw = httpx.post(f"{dep.url}/v1/completions", json=body, headers=dep.headers(), timeout=60).text
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    last = json.loads(events[-2])
    assert last["choices"] == []
    assert (
        last["usage"]["prompt_tokens_details"]["cached_tokens"]
        == warm.usage.prompt_tokens_details.cached_tokens
    )


def test_responses_streamed_and_whole_then_cached(dep):
    client = dep.client()
    kw = {"model": MODEL, "instructions": _fresh() + TEXT, "input": "Summarize.", "max_output_tokens": 4}
    cold = list(client.responses.create(**kw, stream=True))[-1].response.usage
    assert cold.input_tokens > 10 * BLOCK and cold.input_tokens_details.cached_tokens == 0
    whole = client.responses.create(**kw).usage
    _check_hit(whole.input_tokens_details.cached_tokens, whole.input_tokens)
    done = list(client.responses.create(**kw, stream=True))[-1]
    assert done.type in ("response.completed", "response.incomplete")
    assert done.response.usage.input_tokens_details == whole.input_tokens_details
