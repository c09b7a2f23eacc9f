"""Reads before the PDL wait (kernels/pdl.py's EARLY) never see a write of the kernel before.

The decode attention kernel reads its first K/V tile before waiting for the kernel it was launched
behind, leaving out the step's own token at position ctx - 1, which that kernel (the q/k norm and
rotary kernel) stores. Here the kernel before is a stand-in that lets its dependents launch at once,
spins for a while and only then writes the rows: the token at ctx - 1 must still be read as written,
and (the control, which shows the early reads really run ahead of the wait) an earlier token
written the same way is not.

Skipped without a GPU of compute capability 9.0 or later (PDL).
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="needs a CUDA device with PDL (compute capability >= 9.0)",
)

SPIN_NS = 1_000_000  # the stand-in's wait before it writes: far longer than the dependent's launch


def _late_writer():
    import triton
    import triton.language as tl

    @triton.jit
    def late_writer(src_k, src_v, dst_k, dst_v, rows_ptr, D: tl.constexpr, SPIN: tl.constexpr):
        """Lets the next kernel launch, spins SPIN ns, then copies row `program_id` of src into the
        cache row at rows[program_id]."""
        tl.extra.cuda.gdc_launch_dependents()
        i = tl.program_id(0)
        t0 = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=tl.int64,
                                       is_pure=False, pack=1)  # fmt: skip
        now = t0
        while now - t0 < SPIN:
            now = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [i], dtype=tl.int64,
                                            is_pure=False, pack=1)  # fmt: skip
        d = tl.arange(0, D)
        row = tl.load(rows_ptr + i)
        tl.store(dst_k + row + d, tl.load(src_k + i * D + d))
        tl.store(dst_v + row + d, tl.load(src_v + i * D + d))

    return late_writer


@pytest.mark.parametrize("num_splits", [1, 4])
def test_the_steps_own_token_is_read_after_the_wait(num_splits):
    from splitserve.kernels import paged_attention, pdl

    assert pdl.on(torch.device("cuda")) and pdl.EARLY
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    b, kvh, heads, d, bs, num_blocks = 3, 2, 8, 128, 16, 64
    lens = [70, 129, 33] if num_splits > 1 else [40, 64, 200]  # ctx - 1 in a first tile, and in a later one
    k_cache = torch.randn(num_blocks, bs, kvh, d, device=dev, dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn(num_blocks, bs, kvh, d, device=dev, dtype=torch.bfloat16, generator=g)
    perm = torch.randperm(num_blocks, device=dev, generator=g)
    tables = perm[: b * 16].view(b, 16).to(torch.int32)
    context_lens = torch.tensor(lens, device=dev, dtype=torch.int32)
    q = torch.randn(b, heads, d, device=dev, dtype=torch.bfloat16, generator=g)
    writer = _late_writer()

    def row_offsets(position_of) -> torch.Tensor:
        """Element offsets in a cache of the rows at each sequence's `position_of(len)`, each KV head."""
        offs = []
        for s, n in enumerate(lens):
            p = position_of(n)
            block = int(tables[s, p // bs])
            offs += [k_cache.stride(0) * block + k_cache.stride(1) * (p % bs) + k_cache.stride(2) * h
                     for h in range(kvh)]  # fmt: skip
        return torch.tensor(offs, device=dev, dtype=torch.int64)

    def attend_behind_a_late_write(position_of) -> tuple[torch.Tensor, torch.Tensor]:
        """The rows at `position_of(len)` hold garbage until the stand-in writes them late; -> the
        attention launched right behind the stand-in, and the same attention run after it."""
        rows = row_offsets(position_of)
        n = rows.numel()
        src_k = torch.randn(n, d, device=dev, dtype=torch.bfloat16, generator=g)
        src_v = torch.randn(n, d, device=dev, dtype=torch.bfloat16, generator=g)
        flat_k, flat_v = k_cache.view(-1), v_cache.view(-1)
        for r in rows.tolist():  # garbage the attention must not see: a key of weight ~1 / len, a
            flat_k[r : r + d] = 0.0  # value far out of range
            flat_v[r : r + d] = 1e4
        torch.cuda.synchronize()
        writer[(n,)](src_k, src_v, flat_k, flat_v, rows, D=d, SPIN=SPIN_NS, num_warps=1)
        early = paged_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, context_lens, 0.088, num_splits=num_splits
        )
        torch.cuda.synchronize()
        after = paged_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, context_lens, 0.088, num_splits=num_splits
        )
        return early, after

    attend_behind_a_late_write(lambda n: n - 1)  # loads both kernels' modules (a load waits for the GPU)
    for _ in range(3):
        early, after = attend_behind_a_late_write(lambda n: n - 1)
        assert after.isfinite().all() and after.abs().max() < 100
        assert torch.equal(early, after)

    # control: an earlier token written late is read early (as garbage) by the same launch, so the
    # early reads do run before the wait, and the check above could fail
    seen = [not torch.equal(*attend_behind_a_late_write(lambda n: n - 2)) for _ in range(3)]
    assert any(seen)
