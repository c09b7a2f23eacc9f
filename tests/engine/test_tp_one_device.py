"""Tensor parallelism's choices of device and CUDA graphs, on the CPU: `tensor_parallel_one_device` (a
test mode for one GPU) puts every rank on rank 0's device, where ranks otherwise take the devices after
it; a group captures CUDA graphs only where its collectives are NCCL's (never gloo's, on the CPU or in
the one-device mode); and an engine given the option at size 2 on the CPU (where the model's
collectives are gloo's anyway) starts its rank with it and gives the tokens of size 1."""

from __future__ import annotations

import datetime
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from splitserve import LLM, SamplingParams
from splitserve.engine.tp.build import graphs_allowed
from splitserve.engine.tp.group import TPGroup, rank_device

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_one_device_puts_every_rank_on_rank_0s_device():
    cuda1 = torch.device("cuda", 1)
    assert [rank_device(cuda1, r) for r in range(3)] == [torch.device("cuda", i) for i in (1, 2, 3)]
    assert [rank_device(cuda1, r, one_device=True) for r in range(3)] == [cuda1] * 3
    cpu = torch.device("cpu")
    assert rank_device(cpu, 1) == rank_device(cpu, 1, one_device=True) == cpu


def test_graphs_only_over_collectives_a_graph_can_capture(caplog):
    store = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=datetime.timedelta(seconds=30))
    for one_device in (False, True):
        group = TPGroup(0, 1, store, torch.device("cpu"), one_device)
        assert group.dev is group.cpu and not group.capturable and not group.staged
        x = torch.arange(6.0).view(2, 3)
        assert torch.equal(group.all_gather_last(group.all_reduce(x.clone())), x)
    with caplog.at_level(logging.INFO, logger="splitserve.engine.tp.build"):
        assert not graphs_allowed(SimpleNamespace(capturable=False), True)  # type: ignore[arg-type]
    assert "tensor_parallel_one_device" in caplog.text
    assert graphs_allowed(SimpleNamespace(capturable=True), True)  # type: ignore[arg-type]
    assert not graphs_allowed(SimpleNamespace(capturable=True), False)  # type: ignore[arg-type]


def test_the_one_device_option_reaches_the_ranks_and_keeps_the_tokens():
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    prompts = [{"prompt_token_ids": p} for p in ([5, 17, 300, 42, 7], list(range(3, 40)))]
    kw = dict(model="random:qwen3.5-tiny", device="cpu", dtype="float32", max_model_len=128,
              kv_cache_bytes=2**20, max_num_seqs=4, progress=False)  # fmt: skip
    one = [o.outputs[0].token_ids for o in LLM(**kw).generate(prompts, params, use_tqdm=False)]
    llm = LLM(tensor_parallel_size=2, tensor_parallel_one_device=True, **kw)
    try:
        assert llm.engine.runner.group.dev is llm.engine.runner.group.cpu
        assert [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)] == one
    finally:
        llm.engine.runner.close()
