"""Tensor parallelism's code on one GPU, where NCCL cannot pair two ranks.

Two ranks on one device (`tensor_parallel_one_device`: rank 1 a child process on the same GPU, the
model's collectives over gloo through the host, CUDA graphs off): greedy tokens in fp32 equal one
engine's at tensor_parallel_size 1 (which captures its CUDA graphs), for tiny random-weight Llama
(one KV head, replicated on both ranks), Qwen3 and the Qwen3.5 hybrid (Gated DeltaNet heads and state
split), with prompts that share a prefix and prefill in chunks.

CUDA graphs over the model's NCCL collectives: a rank's model built by the tensor-parallel loader with
a group of one rank over NCCL (every row-parallel projection all-reduces, the embedding all-reduces,
the logits are all-gathered, each through ProcessGroupNCCL), run by an engine that captures its decode
graphs (and the hybrid's prefill graphs) around those collectives: its greedy tokens equal the same
model's run eagerly, and its decode steps replay the graphs. The all-gather of one rank copies the
logits into a fresh buffer inside the graph, so wrong tokens would show a collective the replay missed.
Skipped without CUDA."""

from __future__ import annotations

import datetime

import pytest
import torch
import torch.distributed as dist

from splitserve import LLM, SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.tp import build as tp_build
from splitserve.engine.tp.group import TPGroup

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
ENGINE = dict(device="cuda:0", dtype="float32", max_model_len=256, max_num_seqs=4, kv_cache_bytes=16 << 20,
              max_num_batched_tokens=64, progress=False)  # fmt: skip


def _waves() -> list[list[list[int]]]:
    gen = torch.Generator().manual_seed(3)
    system = torch.randint(3, 500, (40,), generator=gen).tolist()
    q = [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 70, 21, 2)]
    return [[system + q[0]], [system + q[1], q[3]], [system + q[2], system + q[0], q[1]]]


def _generate(llm: LLM) -> list[list[list[int]]]:
    out = []
    for wave in _waves():
        res = llm.generate([{"prompt_token_ids": p} for p in wave], GREEDY, use_tqdm=False)
        out.append([r.outputs[0].token_ids for r in res])
    engine = llm.engine
    assert not engine.has_unfinished_requests() and engine.pool.num_free == engine.pool.num_blocks
    return out


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:tiny", "random:qwen3.5-tiny"])
def test_tp2_on_one_gpu_greedy_equals_tp1(model):
    one = _generate(LLM(model=model, **ENGINE))
    assert any(len(set(tokens)) > 3 for wave in one for tokens in wave)  # not a degenerate repeat
    llm = LLM(model=model, tensor_parallel_size=2, tensor_parallel_one_device=True, **ENGINE)
    try:
        assert llm.engine.runner.graphs is None  # gloo's collectives: no graphs, by design
        assert llm.engine.kv_cache.device == torch.device("cuda", 0)
        assert _generate(llm) == one
    finally:
        llm.engine.runner.close()


@pytest.fixture(scope="module")
def nccl_group():
    """A tensor-parallel group of one rank on cuda:0: its `dev` group is ProcessGroupNCCL."""
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=60))
    group = TPGroup(0, 1, store, torch.device("cuda", 0))
    assert group.capturable and isinstance(group.dev, dist.ProcessGroupNCCL)
    return group


@pytest.mark.parametrize("model", ["random:tiny-llama", "random:qwen3.5-tiny"])
def test_graphs_capture_the_models_nccl_collectives(nccl_group, model):
    config = EngineConfig(model=model, **ENGINE)
    loaded, _ = tp_build.load_shard(config, config.torch_device(), torch.float32, nccl_group)
    assert loaded.model.tp is nccl_group  # the parallel layers call the group's collectives
    runs, reduced = {}, {}
    for eager in (True, False):
        engine = LLMEngine(EngineConfig(model=model, enforce_eager=eager, **ENGINE), loaded=loaded)
        assert (engine.runner.graphs is None) == eager
        before = nccl_group.bytes_reduced
        runs[eager] = _generate(LLM.from_engine(engine))
        reduced[eager] = nccl_group.bytes_reduced - before
        if not eager:
            assert engine.runner.replayed is not None and engine.runner.replayed[0] == "decode"
    assert any(len(set(tokens)) > 3 for wave in runs[True] for tokens in wave)
    assert runs[False] == runs[True]
    # the decode steps' collectives ran inside the replayed graphs, not through Python (eager steps only)
    assert 0 < reduced[False] < reduced[True]
