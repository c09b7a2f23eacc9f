"""The OpenAI API through the official `openai` client, against real deployments of the default model:
greedy output equals `splitserve.LLM`, disaggregated equals colocated, every documented field works,
and the answers validate against OpenAI's own schema."""

from __future__ import annotations

import asyncio
import math

import httpx
import pytest
from serve_harness import MODEL, SECRET, check_schema, sse_events

from splitserve import SamplingParams
from splitserve.wire.auth import worker_headers

pytestmark = pytest.mark.slow

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "How many legs does a spider have?",
]


@pytest.fixture(scope="module")
def llm(make_smol_llm):
    return make_smol_llm()


def _chat(dep, content: str, **kw):
    return dep.client().chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": content}], **kw
    )


def test_models_and_health(disaggregated, openai_schema):
    models = disaggregated.client().models.list()
    assert [m.id for m in models.data] == [MODEL]
    raw = httpx.get(f"{disaggregated.url}/v1/models", headers=disaggregated.headers()).json()
    check_schema(openai_schema, "ListModelsResponse", raw)
    assert raw["data"][0]["max_model_len"] == 2048
    assert disaggregated.client().models.retrieve(MODEL).id == MODEL
    health = disaggregated.health()
    assert health["status"] == "ok" and health["ready"] == {"prefill": 1, "decode": 1}
    assert {w["kv_backend"] for w in health["workers"]} == {"shm"}
    assert all("url" not in w for w in health["workers"])  # addresses only behind the key:
    assert httpx.get(f"{disaggregated.url}/admin/deployment", timeout=10).status_code == 401
    workers = disaggregated.admin()["workers"]
    assert {w["role"] for w in workers} == {"prefill", "decode"} and all(w["url"] for w in workers)
    # the workers' own API wants the token derived from the deployment's secret (all but /health)
    for w in workers:
        assert httpx.get(f"{w['url']}/health", timeout=10).status_code == 200
        assert httpx.get(f"{w['url']}/stats", timeout=10).status_code == 401
        assert httpx.post(f"{w['url']}/abort", json={"request_id": "x"}, timeout=10).status_code == 401
        wrong = worker_headers("not-the-secret")
        assert httpx.get(f"{w['url']}/stats", headers=wrong, timeout=10).status_code == 401
        assert httpx.get(f"{w['url']}/stats", headers=worker_headers(SECRET), timeout=10).status_code == 200


def test_greedy_http_equals_llm_both_modes(disaggregated, colocated, llm):
    tok = llm.engine.tokenizer
    params = SamplingParams(temperature=0, max_tokens=48)
    ids = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    expected = [o.outputs[0] for o in llm.generate([{"prompt_token_ids": x} for x in ids], params)]
    for dep in (disaggregated, colocated):
        for prompt, exp in zip(PROMPTS, expected, strict=True):
            got = _chat(dep, prompt, temperature=0, max_tokens=48)
            assert got.choices[0].message.content == exp.text, (dep.url, prompt)
            assert got.choices[0].finish_reason == exp.finish_reason
            assert got.usage.completion_tokens == len(exp.token_ids)
            assert got.usage.prompt_tokens == len(ids[PROMPTS.index(prompt)])


def test_stream_equals_non_stream_and_usage(disaggregated, openai_schema):
    full = _chat(disaggregated, PROMPTS[1], temperature=0, max_tokens=40)
    chunks = list(
        _chat(
            disaggregated,
            PROMPTS[1],
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finals = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert finals == [full.choices[0].finish_reason]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == full.usage.completion_tokens
    # the raw SSE: every chunk is OpenAI's schema, then [DONE]
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": PROMPTS[0]}],
        "max_tokens": 8,
        "stream": True,
    }
    raw = httpx.post(
        f"{disaggregated.url}/v1/chat/completions", json=body, headers=disaggregated.headers(), timeout=60
    ).text
    events = sse_events(raw)
    assert events[-1] == "[DONE]"
    import json

    for e in events[:-1]:
        check_schema(openai_schema, "CreateChatCompletionStreamResponse", json.loads(e))


def test_chat_response_schema_and_ttft_headers(disaggregated, openai_schema):
    body = {"model": MODEL, "messages": [{"role": "user", "content": PROMPTS[0]}], "max_tokens": 8}
    r = httpx.post(
        f"{disaggregated.url}/v1/chat/completions", json=body, headers=disaggregated.headers(), timeout=60
    )
    assert r.status_code == 200
    check_schema(openai_schema, "CreateChatCompletionResponse", r.json())
    assert r.json()["id"].startswith("chatcmpl-") and r.json()["model"] == MODEL
    h = r.headers
    assert h["x-splitserve-kv-backend"] == "shm"
    parts = [float(h[f"x-splitserve-ttft-{p}-ms"]) for p in ("queue", "prefill", "transfer", "first-decode")]
    assert all(p >= 0 for p in parts) and float(h["x-splitserve-ttft-prefill-ms"]) > 0
    assert sum(parts) == pytest.approx(float(h["x-splitserve-ttft-ms"]), abs=0.1)


def test_max_tokens_stop_and_max_completion_tokens(disaggregated):
    r = _chat(disaggregated, PROMPTS[1], temperature=0, max_tokens=5)
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 5
    r = _chat(disaggregated, PROMPTS[1], temperature=0, max_completion_tokens=3)
    assert r.usage.completion_tokens == 3
    full = _chat(disaggregated, PROMPTS[0], temperature=0, max_tokens=30).choices[0].message.content
    word = full.split()[2]
    r = _chat(disaggregated, PROMPTS[0], temperature=0, max_tokens=30, stop=[word])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(word)]


def test_seed_n_and_sampling_fields(disaggregated, colocated):
    kw = dict(
        temperature=0.9,
        top_p=0.9,
        max_tokens=24,
        seed=1234,
        n=3,
        presence_penalty=0.3,
        frequency_penalty=0.2,
        extra_body={"top_k": 40, "min_p": 0.01, "repetition_penalty": 1.1},
    )
    a = _chat(disaggregated, PROMPTS[1], **kw)
    b = _chat(disaggregated, PROMPTS[1], **kw)
    c = _chat(colocated, PROMPTS[1], **kw)
    texts = [x.message.content for x in a.choices]
    assert [x.index for x in a.choices] == [0, 1, 2]
    assert texts == [x.message.content for x in b.choices] == [x.message.content for x in c.choices]
    assert len(set(texts)) > 1  # the n samples differ (seeds seed+i)
    d = _chat(disaggregated, PROMPTS[1], **{**kw, "seed": 99})
    assert [x.message.content for x in d.choices] != texts


@pytest.mark.parametrize(
    "knob",
    [{"top_k": 3}, {"min_p": 0.3}, {"presence_penalty": 1.5}, {"frequency_penalty": 1.5},
     {"repetition_penalty": 1.6}],
)  # fmt: skip
def test_each_sampling_knob_reaches_the_engine_token_exact(disaggregated, llm, knob):
    """A seeded sample with one knob set, served disaggregated, is token for token the engine's with the
    same sampling params, and differs from the engine's without the knob (the knob did something)."""
    ids = llm.engine.tokenizer.apply_chat_template([{"role": "user", "content": PROMPTS[1]}])

    def engine_tokens(**extra) -> list[int]:
        params = SamplingParams(temperature=1.0, seed=11, max_tokens=24, ignore_eos=True, **extra)
        return list(llm.generate([{"prompt_token_ids": ids}], params)[0].outputs[0].token_ids)

    openai_names = {"presence_penalty", "frequency_penalty"}
    kw = {k: v for k, v in knob.items() if k in openai_names}
    extra = {k: v for k, v in knob.items() if k not in openai_names}
    r = _chat(disaggregated, PROMPTS[1], temperature=1.0, seed=11, max_tokens=24, logprobs=True,
              extra_body={"ignore_eos": True, **extra}, **kw)  # fmt: skip
    want = engine_tokens(**knob)
    served = [t.token for t in r.choices[0].logprobs.content]
    assert served == [llm.engine.tokenizer.token_text(t) for t in want] and len(want) == 24
    assert want != engine_tokens()


def test_chat_logprobs_match_llm(disaggregated, llm):
    tok = llm.engine.tokenizer
    ids = tok.apply_chat_template([{"role": "user", "content": PROMPTS[2]}])
    exp = llm.generate([{"prompt_token_ids": ids}], SamplingParams(temperature=0, max_tokens=6, logprobs=3))
    exp_lp = exp[0].outputs[0].logprobs
    r = _chat(disaggregated, PROMPTS[2], temperature=0, max_tokens=6, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == len(exp_lp) == 6
    for got, want in zip(content, exp_lp, strict=True):
        assert got.token == tok.token_text(want.token_id)
        assert math.isclose(got.logprob, want.logprob, abs_tol=1e-4)
        assert len(got.top_logprobs) == 3
        assert [t.token for t in got.top_logprobs] == [tok.token_text(t) for t, _ in want.top]
        assert bytes(got.bytes) == got.token.encode()
    # streamed logprobs are the same
    chunks = list(
        _chat(
            disaggregated, PROMPTS[2], temperature=0, max_tokens=6, logprobs=True, top_logprobs=3, stream=True
        )
    )
    streamed = [
        e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content
    ]
    assert [(e.token, round(e.logprob, 4)) for e in streamed] == [
        (e.token, round(e.logprob, 4)) for e in content
    ]


def test_completions_api(disaggregated, llm, openai_schema):
    client = disaggregated.client()
    exp = llm.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=12))[0].outputs[0]
    r = client.completions.create(model=MODEL, prompt="Once upon a time", max_tokens=12, temperature=0)
    assert r.choices[0].text == exp.text and r.object == "text_completion"
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 3, "logprobs": 1}
    raw = httpx.post(
        f"{disaggregated.url}/v1/completions", json=body, headers=disaggregated.headers(), timeout=60
    ).json()
    check_schema(openai_schema, "CreateCompletionResponse", raw)
    # token ids, a batch of prompts, echo, logprobs
    ids = llm.engine.tokenizer.encode("Once upon a time")
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=12, temperature=0)
    assert r.choices[0].text == exp.text
    r = client.completions.create(
        model=MODEL, prompt=["Once upon a time", "The sky is"], max_tokens=4, temperature=0, n=2
    )
    assert [c.index for c in r.choices] == [0, 1, 2, 3] and r.choices[0].text == r.choices[1].text
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, echo=True
    )
    echoed = r.choices[0].text
    assert echoed.startswith("Once upon a time") and exp.text.startswith(
        echoed.removeprefix("Once upon a time")
    )
    r = client.completions.create(
        model=MODEL, prompt="Once upon a time", max_tokens=4, temperature=0, logprobs=2
    )
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 4
    assert "".join(lp.tokens) == r.choices[0].text and lp.text_offset[0] == 0
    stream = client.completions.create(
        model=MODEL,
        prompt="Once upon a time",
        max_tokens=12,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == exp.text
    assert chunks[-1].usage.completion_tokens == 12


def test_concurrent_clients(disaggregated):
    async def main() -> list[str]:
        client = disaggregated.async_client()
        jobs = [
            client.chat.completions.create(
                model=MODEL, messages=[{"role": "user", "content": p}], temperature=0, max_tokens=24
            )
            for p in PROMPTS * 3
        ]
        return [r.choices[0].message.content for r in await asyncio.gather(*jobs)]

    texts = asyncio.run(main())
    assert texts[:3] == texts[3:6] == texts[6:]
    stats = disaggregated.wait_idle()
    assert all(s["unfinished"] == 0 for s in stats.values())


def test_metrics_endpoint(disaggregated):
    _chat(disaggregated, PROMPTS[0], temperature=0, max_tokens=4)
    text = httpx.get(f"{disaggregated.url}/metrics?fresh=1", timeout=10).text
    for name in (
        "splitserve:time_to_first_token_seconds",
        "splitserve:inter_token_latency_seconds",
        "splitserve:e2e_request_latency_seconds",
        "splitserve:request_queue_time_seconds",
        "splitserve:request_prefill_time_seconds",
        "splitserve:num_requests_running",
        "splitserve:num_requests_waiting",
        "splitserve:kv_cache_usage_perc",
        "splitserve:kv_blocks_held",
    ):
        assert name in text, name
    for name in (  # vLLM's names beside ours (router/vllm_metrics.py)
        "vllm:time_to_first_token_seconds_bucket",
        "vllm:time_per_output_token_seconds_bucket",
        "vllm:inter_token_latency_seconds_bucket",
        "vllm:e2e_request_latency_seconds_bucket",
        "vllm:request_queue_time_seconds_bucket",
        "vllm:request_prefill_time_seconds_bucket",
        "vllm:request_decode_time_seconds_bucket",
        "vllm:request_inference_time_seconds_bucket",
        'vllm:request_success_total{finished_reason="length",model_name="smollm2-135m-instruct"}',
        "vllm:prompt_tokens_total",
        "vllm:generation_tokens_total",
        "vllm:request_prompt_tokens_bucket",
        "vllm:request_generation_tokens_bucket",
        "vllm:request_params_n_bucket",
        "vllm:request_params_max_tokens_bucket",
        'vllm:num_requests_running{model_name="smollm2-135m-instruct",role="prefill",worker=',
        'vllm:num_requests_waiting{model_name="smollm2-135m-instruct",role="decode",worker=',
        'vllm:kv_cache_usage_perc{model_name="smollm2-135m-instruct",role="decode"',
        "vllm:prefix_cache_queries_total",
        "vllm:prefix_cache_hits_total",
        "vllm:num_preemptions_total",
        'vllm:iteration_tokens_total_bucket{le="+Inf",model_name="smollm2-135m-instruct",role="prefill"',
    ):
        assert name in text, name
    assert 'splitserve:kv_transfer_seconds_count{backend="shm",model_name="smollm2-135m-instruct"}' in text
    assert 'splitserve:kv_transfer_bytes_total{backend="shm"' in text
    assert 'splitserve:kv_backend_info{backend="shm"' in text


def test_overload_answers_429_with_retry_after(colocated):
    """2 running + 1 queued fit; the rest are refused at once with 429 and Retry-After."""

    async def main() -> list[httpx.Response]:
        async with httpx.AsyncClient(timeout=120) as client:
            body = {
                "model": MODEL,
                "prompt": "Count to one hundred:",
                "max_tokens": 64,
                "temperature": 0,
                "ignore_eos": True,
            }
            return await asyncio.gather(
                *(client.post(f"{colocated.url}/v1/completions", json=body) for _ in range(6))
            )

    results = asyncio.run(main())
    codes = sorted(r.status_code for r in results)
    assert codes.count(200) >= 3 and codes.count(429) >= 1, codes
    refused = next(r for r in results if r.status_code == 429)
    assert refused.headers["retry-after"] == "1"
    assert refused.json()["error"]["code"] == "queue_full"
    assert _chat(colocated, PROMPTS[0], max_tokens=2).choices[0].finish_reason in ("length", "stop")
