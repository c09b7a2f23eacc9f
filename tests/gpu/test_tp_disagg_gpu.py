"""Prefill and decode at different tensor-parallel sizes on CUDA, engine to engine in one process: each
engine at size 2 runs its two ranks on the one GPU (`tensor_parallel_one_device`; rank 1 a child
process), fp32. A request prefilled at size 1 and decoded at size 2, or prefilled at 2 and decoded at
1, gives the greedy tokens of one engine at size 1, over tcp and shm, for tiny random-weight Llama (one
KV head, on both ranks) and the Qwen3.5 hybrid (KV heads and Gated DeltaNet state channels split):
each rank's KV and state move between the device pools through that rank's own transport. Afterwards
every block, state slot and lease is free on both sides. tests/kv_transfer/test_tp_disagg.py is the
CPU's version. Skipped without CUDA."""

from __future__ import annotations

import time

import pytest
import torch

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.kv_connector import KVConnector
from splitserve.transport import TransportOptions

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SECRET = "tp-gpu-test-secret"
GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 37, 18)]


class Engines:
    """One engine (with its connector) per (model, size, backend, name), made on first use."""

    def __init__(self) -> None:
        self.made: dict[tuple, tuple[LLMEngine, KVConnector]] = {}

    def get(self, model: str, size: int, backend: str, name: str) -> tuple[LLMEngine, KVConnector]:
        key = (model, size, backend, name)
        if key not in self.made:
            config = EngineConfig(model=model, device="cuda:0", dtype="float32", max_model_len=128,
                                  kv_cache_bytes=4 << 20, max_num_seqs=4, tensor_parallel_size=size,
                                  tensor_parallel_one_device=size > 1, progress=False)  # fmt: skip
            engine = LLMEngine(config, tokenizer=None)
            options = TransportOptions(lease_s=30.0, fetch_timeout_s=30.0)
            self.made[key] = engine, KVConnector.open(engine, backend, secret=SECRET, options=options)
        return self.made[key]

    def close(self) -> None:
        for engine, conn in self.made.values():
            conn.close()
            if engine.config.tensor_parallel_size > 1:
                engine.runner.close()


@pytest.fixture(scope="module")
def engines():
    made = Engines()
    yield made
    made.close()


def _run(engine: LLMEngine) -> dict:
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def _colocated(engine: LLMEngine) -> list[list[int]]:
    for i, p in enumerate(_prompts()):
        engine.add_request(p, GREEDY, request_id=f"c{i}")
    done = _run(engine)
    return [done[f"c{i}"].outputs[0].token_ids for i in range(len(_prompts()))]


def _disaggregated(p: LLMEngine, d: LLMEngine, tag: str) -> list[list[int]]:
    prompts = _prompts()
    for i, prompt in enumerate(prompts):
        p.add_request(prompt, GREEDY, request_id=f"{tag}p{i}", kv_transfer="export")
    exported = _run(p)
    for i, prompt in enumerate(prompts):
        out = exported[f"{tag}p{i}"]
        d.add_request_with_kv(out.kv_export.handle, prompt, out.outputs[0].token_ids[0], GREEDY, f"{tag}d{i}")
    done = _run(d)
    return [done[f"{tag}d{i}"].outputs[0].token_ids for i in range(len(prompts))]


def _all_free(engine: LLMEngine, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while True:
        engine.free_released_kv()
        free = (
            engine.pool.num_free == engine.pool.num_blocks
            and engine.states.num_free == engine.states.num_slots
        )
        if free or time.monotonic() > deadline:
            return free
        time.sleep(0.05)


@pytest.mark.parametrize("backend", ["tcp", "shm"])
@pytest.mark.parametrize("model", ["random:tiny-llama", "random:qwen3.5-tiny"])
@pytest.mark.parametrize("sizes", [(1, 2), (2, 1)], ids=lambda s: f"P{s[0]}D{s[1]}")
def test_pd_across_tensor_parallel_sizes_on_cuda_equals_colocated(engines, backend, model, sizes):
    reference = _colocated(engines.get(model, 1, backend, "p")[0])
    assert any(len(set(t)) > 2 for t in reference)  # not a degenerate repeat
    (p, pc), (d, _) = engines.get(model, sizes[0], backend, "p"), engines.get(model, sizes[1], backend, "d")
    assert p.kv_cache.is_cuda and d.kv_cache.is_cuda
    assert _disaggregated(p, d, f"{backend}{sizes}") == reference
    assert _all_free(d) and _all_free(p)
    assert pc.transport.describe().leases.active == 0
