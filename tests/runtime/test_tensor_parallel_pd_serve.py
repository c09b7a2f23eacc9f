"""`splitserve serve` in disaggregated mode with prefill and decode at different tensor-parallel sizes
on the CPU (gloo), the Qwen3.5 hybrid (KV heads and Gated DeltaNet state split per rank): streamed
greedy answers equal one process's at tensor_parallel_size 1, for prefill 2 -> decode 1 over shm and
prefill 1 -> decode 2 over tcp; afterwards every worker's blocks are free and no lease is held."""

from __future__ import annotations

import openai
import pytest
from serve_harness import manifest_yaml, start_deployment

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "random:qwen3.5-tiny"
PROMPTS = [[5, 17, 300, 42, 7, 99, 250], list(range(1, 40))]


@pytest.fixture(scope="module")
def expected() -> list[str]:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=MODEL, max_model_len=256, kv_cache_bytes=16 << 20, progress=False)
    return [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]


def _texts(client: openai.OpenAI) -> list[str]:
    out = []
    for prompt in PROMPTS:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        out.append("".join(c.choices[0].text for c in chunks if c.choices))
    return out


@pytest.mark.parametrize("sizes", [(2, 1, "shm"), (1, 2, "tcp")], ids=lambda s: f"P{s[0]}D{s[1]}-{s[2]}")
def test_pd_across_tensor_parallel_sizes_streams_tp1_tokens(expected, sizes):
    prefill, decode, backend = sizes
    dep = start_deployment(
        manifest_yaml(
            mode="disaggregated",
            model={"source": MODEL, "max_model_len": 1024},
            engine={"kv_cache_mb": 8, "max_num_seqs": 4},
            prefill={"replicas": 1, "engine": {"tensor_parallel_size": prefill}},
            decode={"replicas": 1, "engine": {"tensor_parallel_size": decode}},
            transport={"backend": backend},
        )
    )
    try:
        assert _texts(dep.client(timeout=60)) == expected
        stats = dep.wait_idle(timeout_s=20)
        assert all(s["blocks"]["free"] == s["blocks"]["total"] for s in stats.values()), stats
        for s in stats.values():
            leases = (s["kv_transfer"] or {}).get("transport", {}).get("leases", {})
            assert leases.get("active", 0) == 0, s["kv_transfer"]
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
