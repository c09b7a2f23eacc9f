"""`memory_utilization` is the share of the device that the whole worker process may hold: the memory
plan (engine/memory_plan.py) pays weights, the CUDA context, the profiled activations, the graphs, the
transport's buffers, grammar masks, state checkpoints and a margin first, then splits the rest between
the recurrent-state slots and the KV blocks; every piece adds up to at most the share. A share too small
for the weights, or for one max_model_len sequence, or more than the device has free, is refused with
the figures; `kv_cache_mb` fixes the KV cache instead and is refused where the device cannot hold the
total. Pure arithmetic (CI has no GPU)."""

from __future__ import annotations

import dataclasses

import pytest

from splitserve.engine.memory_plan import (
    MIN_MARGIN_BYTES,
    FixedCosts,
    MemoryInputs,
    MemoryShareError,
    margin_bytes,
    plan_memory,
)

GIB, MIB = 2**30, 2**20
H100 = 80 * GIB  # about what an 80 GB card reports


def qwen35_9b(**over) -> MemoryInputs:
    """A Qwen3.5-9B worker (18 GiB of weights, 50 MiB of state a sequence, 512 KiB KV blocks) alone
    on an 80 GB card at memory_utilization 0.45, with max_model_len 2240 and 64 sequences."""
    base = dict(
        device_total=H100, device_free=H100 - 18 * GIB - 700 * MIB, held=18 * GIB + 700 * MIB,
        weights=18 * GIB, non_torch=700 * MIB, activations=3 * GIB, graphs=400 * MIB, transfer=400 * MIB,
        grammar=4 * MIB, checkpoints=400 * MIB, slot_bytes=50 * MIB, max_slots=64, scratch_slot=True,
        block_bytes=512 * 1024, blocks_per_seq=140, share=int(H100 * 0.45),
    )  # fmt: skip
    args = {**base, **over}
    costs = FixedCosts(**{f.name: args.pop(f.name) for f in dataclasses.fields(FixedCosts)})
    return MemoryInputs(costs=costs, **args)


def test_every_piece_fits_inside_the_share():
    inp = qwen35_9b()
    plan = plan_memory(inp)
    assert plan.total <= inp.share
    assert inp.share - plan.total < inp.block_bytes  # all but a block's rounding is handed out
    assert plan.state_slots == 64 and plan.state_bytes == 65 * 50 * MIB  # the graphs' scratch slot too
    assert plan.margin == margin_bytes(inp.share) == int(0.02 * inp.share)
    fixed = 18 * GIB + 700 * MIB + 3 * GIB + 400 * MIB + 400 * MIB + 4 * MIB + 400 * MIB
    rest = inp.share - fixed - plan.margin - plan.state_bytes
    assert plan.num_blocks == rest // inp.block_bytes and plan.kv_bytes == plan.num_blocks * inp.block_bytes


def test_two_workers_on_one_gpu_get_the_same_plan():
    first = plan_memory(qwen35_9b())
    # the second starts once the first holds its whole share: less is free, the same share is its own
    held = int(H100 * 0.45)
    second = plan_memory(qwen35_9b(device_free=H100 - held - 18 * GIB - 700 * MIB))
    assert second == first


def test_a_tight_share_makes_fewer_state_slots_and_keeps_kv_for_them():
    # the reference's shape: 22 GiB a worker, max_model_len 4096 (256 blocks), activations of 2k tokens
    inp = qwen35_9b(share=22 * GIB, activations=700 * MIB, blocks_per_seq=256, checkpoints=8 * 50 * MIB)
    plan = plan_memory(inp)
    assert plan.total <= inp.share
    assert 1 <= plan.state_slots < 64
    # every slot could hold a max_model_len sequence at once
    assert plan.num_blocks >= plan.state_slots * inp.blocks_per_seq
    assert plan.margin == MIN_MARGIN_BYTES


def test_models_without_state_keep_max_num_seqs():
    plan = plan_memory(qwen35_9b(slot_bytes=0, checkpoints=0, transfer=0))
    assert plan.state_slots == 64 and plan.state_bytes == 0
    assert plan.total <= int(H100 * 0.45)


def test_a_share_below_the_weights_is_refused_with_the_figures():
    with pytest.raises(MemoryShareError, match=r"8\.00 GiB .* weights \(18\.00 GiB\)"):
        plan_memory(qwen35_9b(share=8 * GIB))


def test_a_share_without_room_for_one_sequence_is_refused():
    with pytest.raises(MemoryShareError, match="less than one sequence of max_model_len needs") as err:
        plan_memory(qwen35_9b(share=22 * GIB, activations=4 * GIB))
    assert "activations 4.00 GiB" in str(err.value) and "lower max_num_batched_tokens" in str(err.value)


def test_a_share_beyond_what_is_free_is_refused():
    # another process holds 50 GiB: 0.45 of the card is more than is left to this one
    inp = qwen35_9b(device_free=H100 - 50 * GIB - 18 * GIB - 700 * MIB)
    with pytest.raises(MemoryShareError, match="lower memory_utilization .* or give kv_cache_mb"):
        plan_memory(inp)


def test_kv_cache_mb_fixes_the_kv_and_counts_the_rest():
    inp = qwen35_9b(share=None, kv_bytes=2 * GIB)
    plan = plan_memory(inp)
    assert plan.kv_bytes == 2 * GIB and plan.num_blocks == 4096 and plan.state_slots == 64
    assert plan.total == 18 * GIB + 700 * MIB + 3 * GIB + 1204 * MIB + 65 * 50 * MIB + 2 * GIB + plan.margin
    # more than the device can hold: refused before anything is allocated
    with pytest.raises(MemoryShareError, match="lower kv_cache_mb"):
        plan_memory(dataclasses.replace(inp, kv_bytes=70 * GIB))
