"""Prefill CUDA graphs (engine/prefill_graphs.py) on a small Qwen3.5 in fp32: greedy tokens with the graphs
equal the eager fla path's and the torch rule's token for token, one request at a time (every step one
chunk, so graphs replay), chunked mid-prompt, and on prefix-cache hits (a short chunk from a restored
state checkpoint, at a position past 0).

Skipped without a GPU or fla-core (Triton's fp32 dots in IEEE fp32: tests/gpu/conftest.py).
"""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.engine import prefill_graphs
from splitserve.model import gdn_prefill
from splitserve.model.random_weights import SMALL_QWEN3_5

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or gdn_prefill.fla_rule() is None, reason="needs CUDA and fla-core"
)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("small_qwen3_5_graphs")
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL_QWEN3_5)).save_pretrained(path)
    return str(path)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(2)
    lens = (7, 63, 64, 65, 128, 130, 200, 256, 300)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in lens]


def _shared() -> list[list[int]]:
    g = torch.Generator().manual_seed(3)
    system = torch.randint(0, 512, (96,), generator=g).tolist()
    return [system + torch.randint(0, 512, (n,), generator=g).tolist() for n in (20, 40, 64, 9, 100)]


def _run(path, backend, graphs, prompts, monkeypatch, **knobs):
    monkeypatch.setenv(prefill_graphs.ENV, str(graphs))
    llm = LLM(
        model=path, device="cuda", dtype="float32", kv_cache_bytes=64 * 2**20, progress=False,
        linear_attention_backend=backend, max_num_seqs=8, **knobs,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    outs = [  # one at a time: every prefill step is one chunk
        llm.generate([{"prompt_token_ids": p}], params, use_tqdm=False)[0].outputs[0].token_ids
        for p in prompts
    ]
    pg = llm.engine.runner.prefill_graphs
    return outs, (pg.replays if pg is not None else 0)


@pytest.mark.parametrize("budget", [2048, 100])
def test_graphs_equal_eager_and_torch(checkpoint, monkeypatch, budget):
    prompts = _prompts()
    ref, _ = _run(checkpoint, "torch", 0, prompts, monkeypatch, max_num_batched_tokens=budget)
    eager, replays = _run(checkpoint, "fla", 0, prompts, monkeypatch, max_num_batched_tokens=budget)
    assert replays == 0
    got, replays = _run(checkpoint, "fla", 256, prompts, monkeypatch, max_num_batched_tokens=budget)
    assert replays > 0
    assert eager == ref
    assert got == ref


def test_graphs_on_prefix_cache_hits(checkpoint, monkeypatch):
    prompts = _shared()
    ref, _ = _run(checkpoint, "torch", 0, prompts, monkeypatch, enable_prefix_caching=False)
    got, replays = _run(checkpoint, "fla", 256, prompts, monkeypatch, enable_prefix_caching=True)
    assert replays >= len(prompts) - 2  # the hits' tails (and the recording request's chunks)
    assert got == ref
