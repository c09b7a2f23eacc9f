"""`model.source: random:SHAPE`: random weights at a named shape, served like a checkpoint (the GPU
benchmarks' deployments use it at Qwen3-8B's shape; here the tiny shape on the CPU)."""

from __future__ import annotations

import json

import pytest
from serve_harness import manifest_yaml, start_deployment

from splitserve import LLM, SamplingParams
from splitserve.config import parse_manifest
from splitserve.model.checkpoint import default_model_path, tokenizer_path
from splitserve.model.random_weights import random_source_config
from splitserve.runtime.local import worker_argv

PROMPTS = [[5, 17, 300, 42, 7, 99, 250], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18]]


def test_random_sources_name_shapes_and_tokenizers():
    assert random_source_config("random:tiny")["hidden_size"] == 64
    assert random_source_config("random:qwen3-8b") == random_source_config("random:qwen3-8b-random")
    with pytest.raises(ValueError, match="known: random:qwen3-8b"):
        random_source_config("random:nope")
    # a random model has no tokenizer of its own: the embedded default model's, unless one is named
    assert tokenizer_path("random:tiny") == default_model_path()
    assert str(tokenizer_path("random:tiny", "/some/dir")) == "/some/dir"
    assert str(tokenizer_path("/models/x")) == "/models/x"


def test_manifest_passes_the_tokenizer_to_every_worker():
    m = parse_manifest("model: {source: 'random:tiny', tokenizer: /tok/dir}\nmode: disaggregated\n")
    for role in ("prefill", "decode"):
        argv = worker_argv(m, role, 0, "SPLITSERVE_KV_SECRET")
        spec = json.loads(argv[argv.index("--spec") + 1])
        assert (spec["engine"]["model"], spec["engine"]["tokenizer"]) == ("random:tiny", "/tok/dir")


def test_random_model_served_disaggregated_equals_the_engine():
    """Prefill and decode workers build the same weights (one seed) on their own: the KV handshake
    accepts them, and greedy answers over HTTP equal the engine's, streamed too, where with
    `server.stream_interval: 4` the first chunk carries the first token alone (TTFT) and every later
    chunk but the last at least 4 tokens (vLLM's `--stream-interval` does the same)."""
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model="random:tiny", max_model_len=256, kv_cache_bytes=16 << 20, progress=False)
    assert llm.engine.loaded.load_stats["method"] == "random"
    expected = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    dep = start_deployment(
        manifest_yaml(
            mode="disaggregated",
            model={"source": "random:tiny", "max_model_len": 256},
            engine={"kv_cache_mb": 16, "max_num_seqs": 8},
            server={"port": 0, "stream_interval": 4},
        )  # fmt: skip
    )
    try:
        assert {w["info"]["load"]["method"] for w in dep.workers} == {"random"}
        client = dep.client()
        for prompt, text in zip(PROMPTS, expected, strict=True):
            r = client.completions.create(model="random:tiny", prompt=prompt, max_tokens=12, temperature=0,
                                          extra_body={"ignore_eos": True})  # fmt: skip
            assert r.choices[0].text == text
            assert r.usage.completion_tokens == 12
            chunks = client.completions.create(
                model="random:tiny", prompt=prompt, max_tokens=12, temperature=0, stream=True, logprobs=0,
                extra_body={"ignore_eos": True},
            )  # fmt: skip
            pieces = [c.choices[0] for c in chunks if c.choices]
            assert "".join(p.text for p in pieces) == text
            sizes = [len(p.logprobs.tokens) for p in pieces if p.logprobs is not None]
            assert sum(sizes) == 12 and sizes[0] == 1 and all(n >= 4 for n in sizes[1:-1]), sizes
            assert len(sizes) <= 4, sizes
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
