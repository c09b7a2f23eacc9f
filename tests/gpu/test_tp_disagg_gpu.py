"""Prefill and decode at different tensor-parallel sizes on CUDA, engine to engine in one process: each
engine at size 2 runs its two ranks on the one GPU (`tensor_parallel_one_device`; rank 1 a child
process), fp32. A request prefilled at size 1 and decoded at size 2, or prefilled at 2 and decoded at
1, gives the greedy tokens of one engine at size 1, over tcp, shm and cuda_ipc, for tiny random-weight
Llama (one KV head, on both ranks) and the Qwen3.5 hybrid (KV heads and Gated DeltaNet state channels
split): each rank's KV and state move between the device pools through that rank's own transport
(over cuda_ipc, each decode rank's GPU copies only its heads and state channels out of the prefill
ranks' mapped pools, from its own process), and each decode rank is written the same bytes. Afterwards
every block, state slot and lease is free on both sides. tests/kv_transfer/test_tp_disagg.py is the
CPU's version (tests/transport/test_cuda_ipc_parts_cpu.py: cuda_ipc's copies through its CPU test
doubles). Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch
from tp_pd_engines import Engines, all_free, colocated, disaggregated

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

SECRET = "tp-gpu-test-secret"


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(7)
    return [torch.randint(3, 500, (n,), generator=gen).tolist() for n in (5, 37, 18)]


@pytest.fixture(scope="module")
def engines():
    made = Engines(SECRET, device="cuda:0", kv_bytes=4 << 20, fetch_timeout_s=30.0,
                   config=lambda size, backend: {"tensor_parallel_one_device": size > 1})  # fmt: skip
    yield made
    made.close()


@pytest.mark.parametrize("backend", ["tcp", "shm", "cuda_ipc"])
@pytest.mark.parametrize("model", ["random:tiny-llama", "random:qwen3.5-tiny"])
@pytest.mark.parametrize("sizes", [(1, 2), (2, 1)], ids=lambda s: f"P{s[0]}D{s[1]}")
def test_pd_across_tensor_parallel_sizes_on_cuda_equals_colocated(engines, backend, model, sizes):
    reference = colocated(engines.get(model, 1, backend, "p")[0], _prompts())
    assert any(len(set(t)) > 2 for t in reference)  # not a degenerate repeat
    (p, pc), (d, dc) = engines.get(model, sizes[0], backend, "p"), engines.get(model, sizes[1], backend, "d")
    assert p.kv_cache.is_cuda and d.kv_cache.is_cuda
    assert disaggregated(p, d, _prompts(), f"{backend}{sizes}") == reference
    assert all_free(d) and all_free(p)
    assert pc.transport.describe().leases.active == 0
    info = dc.transport.describe()
    assert info.backend == backend and not info.counts.get("fallbacks")
    if sizes[1] == 2:  # each decode rank was written its own heads and channels only: the same bytes
        written = info.tensor_parallel.fetched_bytes
        assert written[0] == written[1] > 0
    if backend == "cuda_ipc":  # rank 0's reads were part copies on its GPU, out of the mapped pools
        peers = (getattr(dc.transport, "fetcher", None) or dc.sharded).peers.values()
        copies = [k for peer in peers for k in peer.describe().copies]
        assert copies and all("_part_" in k for k in copies)
