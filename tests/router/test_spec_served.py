"""Speculative decoding served: `engine.speculative_config` in the manifest reaches every worker of a
real deployment (`splitserve serve`, real HTTP), and greedy answers, whole and streamed, equal the
engine's without speculation, colocated and disaggregated: `ngram` on the default model (SmolLM2) with
prompts that quote themselves, so drafts are accepted; `mtp` on the tiny random Qwen3.5 with its MTP
head, split, where the prefill worker's head K/V travel with the prompt's KV."""

from __future__ import annotations

import pytest
from serve_harness import manifest_yaml, start_deployment

from splitserve import LLM, SamplingParams

NGRAM = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
MTP = {"method": "mtp", "num_speculative_tokens": 2}
QUOTES = [
    "The KV cache holds the keys and values of every past token. Repeat this sentence word for word: "
    "The KV cache holds the keys and values",
    "Prefill computes the prompt, decode produces the answer one token at a time. Again: Prefill computes",
]
MAX_NEW = 24


def _check(dep, model: str, prompts: list, expected: list[str]) -> None:
    client = dep.client(timeout=120)
    for prompt, text in zip(prompts, expected, strict=True):
        kw = {"model": model, "prompt": prompt, "max_tokens": MAX_NEW, "temperature": 0,
              "extra_body": {"ignore_eos": True}}  # fmt: skip
        r = client.completions.create(**kw)
        assert r.choices[0].text == text
        assert r.usage.completion_tokens == MAX_NEW
        streamed = "".join(
            c.choices[0].text for c in client.completions.create(**kw, stream=True) if c.choices
        )
        assert streamed == text


def _spec_counts(dep) -> dict[str, dict]:
    return {name: s.get("spec_decode") or {} for name, s in dep.worker_stats().items()}


@pytest.fixture(scope="module")
def quoted() -> tuple[list[list[int]], list[str]]:
    """The quoting prompts as token ids, and the default model's greedy answers without speculation."""
    llm = LLM(max_model_len=512, kv_cache_bytes=32 << 20, progress=False)
    prompts = [llm.engine.tokenizer.encode(q) for q in QUOTES]
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return prompts, [o.outputs[0].text for o in outs]


@pytest.mark.parametrize("mode", ["colocated", "disaggregated"])
def test_ngram_served_equals_no_speculation(quoted, mode):
    prompts, expected = quoted
    dep = start_deployment(manifest_yaml(mode=mode, engine={"speculative_config": NGRAM}))
    try:
        _check(dep, "smollm2-135m-instruct", prompts, expected)
        counts = _spec_counts(dep)
        drafting = [c for name, c in counts.items() if not name.startswith("prefill")]
        assert drafting and all(c["method"] == "ngram" and c["num_accepted_tokens"] > 0 for c in drafting)
        # a prefill worker stops after the first token: nothing for it to verify
        assert all(c.get("num_drafts", 0) == 0 for name, c in counts.items() if name.startswith("prefill"))
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)


def test_mtp_served_split_equals_no_speculation():
    prompts = [[5, 17, 300, 42, 7, 99, 250, 5, 17, 300], list(range(1, 40))]
    llm = LLM(model="random:qwen3.5-tiny", max_model_len=256, kv_cache_bytes=16 << 20, progress=False)
    params = SamplingParams(temperature=0, max_tokens=MAX_NEW, ignore_eos=True)
    expected = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in prompts], params)]
    model = {"source": "random:qwen3.5-tiny", "max_model_len": 256}
    engine = {"kv_cache_mb": 16, "max_num_seqs": 8, "speculative_config": MTP}
    manifest = manifest_yaml(mode="disaggregated", model=model, engine=engine)
    dep = start_deployment(manifest)
    try:
        _check(dep, "random:qwen3.5-tiny", prompts, expected)
        decode = [c for name, c in _spec_counts(dep).items() if name.startswith("decode")]
        assert decode and all(c["method"] == "mtp" and c["num_drafts"] > 0 for c in decode)
        # drafts from the first step after each import: the head's state came with the KV
        assert sum(c["num_first_step_drafts"] for c in decode) == 2 * len(prompts)  # whole and streamed
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
