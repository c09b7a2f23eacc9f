"""model/parallel.py on its own, in one process: two shards of a tiny random model run side by side in
two threads, their collectives met through a barrier, and each returns the unsharded model's logits
for a prompt (to fp32 rounding: the shards' partial products are summed in another order). Runs on the
CPU, and on a CUDA device when one is present (both shards on it)."""

from __future__ import annotations

import threading

import pytest
import torch

from splitserve.model.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from splitserve.model.decoder import ForwardContext
from splitserve.model.parallel import shard_model
from splitserve.model.random_weights import hf_state_dict, random_model, random_source_config

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


class ThreadCollectives:
    """`Collectives` for ranks that are threads of one process."""

    def __init__(self, rank: int, shared: dict) -> None:
        self.rank, self.size, self.shared = rank, shared["size"], shared

    def _exchange(self, x: torch.Tensor) -> list[torch.Tensor]:
        slots, barrier = self.shared["slots"], self.shared["barrier"]
        slots[self.rank] = x.clone()
        barrier.wait()
        parts = list(slots)
        barrier.wait()
        return parts

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        parts = self._exchange(x)
        total = parts[0]
        for p in parts[1:]:
            total = total + p
        return x.copy_(total)

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat(self._exchange(x), dim=-1)


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    cfg, t, dev = model.cfg, len(ids), ids.device
    blocks = -(-t // 16)
    kv = torch.zeros((blocks, cfg.num_kv_layers, 2, 16, cfg.num_kv_heads, cfg.head_dim), device=dev)
    hybrid = bool(model.state_shapes())
    meta = AttentionMetadata(
        slot_mapping=torch.arange(t, device=dev), num_decode_tokens=0, decode_groups=(),
        prefills=(PrefillChunk(0, t, t, torch.arange(blocks, device=dev)),),
        seq_slots=torch.zeros(1, dtype=torch.int64, device=dev) if hybrid else None,
    )  # fmt: skip
    states = {n: torch.zeros((1, *s), dtype=d, device=dev) for n, (s, d) in model.state_shapes().items()}
    ctx = ForwardContext(TorchPagedAttention(cfg.head_dim**-0.5), meta, kv, states)
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(t, device=dev), ctx))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("shape", ["random:tiny-llama", "random:tiny", "random:qwen3.5-tiny"])
def test_two_shards_give_the_unsharded_logits(shape, device):
    full = random_model(random_source_config(shape), device, torch.float32, 256, std=0.1)
    ids = torch.randint(0, full.config.vocab_size, (37,), generator=torch.Generator().manual_seed(1)).to(
        device
    )
    expected = _logits(full.model, ids)
    named = hf_state_dict(full.model)
    shared = {"size": 2, "slots": [None, None], "barrier": threading.Barrier(2, timeout=60)}
    got: dict[int, torch.Tensor] = {}

    def rank(r: int) -> None:
        shard = shard_model(full.model, named, ThreadCollectives(r, shared), torch.device(device), 256)
        got[r] = _logits(shard, ids)

    threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for r in (0, 1):
        torch.testing.assert_close(got[r], expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got[0], got[1])  # every rank holds the same logits
