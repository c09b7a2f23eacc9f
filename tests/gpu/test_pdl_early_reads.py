"""Reads before the PDL wait (kernels/pdl.py's EARLY) never see a write of the kernel before.

The decode attention kernel reads its first K/V tile before waiting for the kernel it was launched
behind, leaving out the step's own token at position ctx - 1, which that kernel (the q/k norm and
rotary kernel) stores. Here the kernel before is a stand-in that lets its dependents launch at once,
spins for a while and only then writes the rows: the token at ctx - 1 must still be read as written,
and (the control, which shows the early reads really run ahead of the wait) an earlier token
written the same way is not. With `fresh` = 4 (a verify chunk's rows, whose chunk's earlier tokens the
step stores too) each of the last four tokens written late is read as written.

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


# (context length, which token the stand-in writes late: 1 = the step's own at ctx - 1, 2 = the one
# before, the control); with 1, 2 and 4 splits ctx - 1 falls in a split's first tile and, for 200 (1
# split) and 250 (2 splits), in a later one; the controls' ctx - 2 is in the first tile of split 0
# (tiles of 64 tokens), whatever the splits
SEQS = [(40, 1), (64, 1), (200, 1), (70, 1), (129, 1), (33, 1), (250, 1), (62, 2), (50, 2)]
# a verify chunk's rows (fresh = 4: their last 4 tokens are stored by the step): any of those written
# late is read after the wait; the controls' token 5 back, in the first tile of split 0, is not
SEQS_FRESH = {
    1: SEQS,
    4: [(40, 1), (64, 3), (200, 4), (70, 2), (129, 4), (33, 3), (250, 1), (62, 5), (50, 5)],
}


@pytest.mark.parametrize("fresh", [1, 4])
@pytest.mark.parametrize("num_splits", [1, 2, 4])
def test_the_steps_own_token_is_read_after_the_wait(num_splits, fresh):
    """In one launch behind the late writer: every sequence whose own token was written late gets the
    result of the same attention run afterwards, and the controls do not (their earlier token was read
    early, as garbage), which shows that this launch did run ahead of the wait."""
    from splitserve.kernels import paged_attention, pdl

    assert pdl.on(torch.device("cuda")) and paged_attention.pdl_early
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    kvh, heads, d, bs = 2, 8, 128, 16
    seqs = SEQS_FRESH[fresh]
    lens = [n for n, _ in seqs]
    b, width = len(lens), -(-max(lens) // bs)
    k_cache = torch.randn(b * width + 4, bs, kvh, d, device=dev, dtype=torch.bfloat16, generator=g)
    v_cache = torch.randn_like(k_cache)
    perm = torch.randperm(k_cache.shape[0], device=dev, generator=g)
    tables = perm[: b * width].view(b, width).to(torch.int32)
    context_lens = torch.tensor(lens, device=dev, dtype=torch.int32)
    q = torch.randn(b, heads, d, device=dev, dtype=torch.bfloat16, generator=g)
    writer = _late_writer()
    flat_k, flat_v = k_cache.view(-1), v_cache.view(-1)
    offs = []  # element offsets of the rows written late: each sequence's late token, each KV head
    for s, (n, back) in enumerate(seqs):
        p = n - back
        block = int(tables[s, p // bs])
        offs += [k_cache.stride(0) * block + k_cache.stride(1) * (p % bs) + k_cache.stride(2) * h
                 for h in range(kvh)]  # fmt: skip
    rows = torch.tensor(offs, device=dev, dtype=torch.int64)
    own = torch.tensor([back <= fresh for _, back in seqs], device=dev)

    def attend_behind_a_late_write() -> tuple[torch.Tensor, torch.Tensor]:
        """-> the attention launched right behind the stand-in, and the same attention run after it."""
        src_k = torch.randn(len(offs), d, device=dev, dtype=torch.bfloat16, generator=g)
        src_v = torch.randn(len(offs), d, device=dev, dtype=torch.bfloat16, generator=g)
        for r in offs:  # garbage the attention must not see: a key of weight ~1 / len, a value far
            flat_k[r : r + d] = 0.0  # out of range
            flat_v[r : r + d] = 1e4
        torch.cuda.synchronize()
        writer[(len(offs),)](src_k, src_v, flat_k, flat_v, rows, D=d, SPIN=SPIN_NS, num_warps=1)
        early = paged_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, context_lens, 0.088, num_splits=num_splits, fresh=fresh
        )
        torch.cuda.synchronize()
        after = paged_attention.paged_decode_attention(
            q, k_cache, v_cache, tables, context_lens, 0.088, num_splits=num_splits, fresh=fresh
        )
        return early, after

    attend_behind_a_late_write()  # loads both kernels' modules (a load waits for the GPU)
    for _ in range(3):
        early, after = attend_behind_a_late_write()
        assert after.isfinite().all() and after.abs().max() < 100
        same = (early == after).flatten(1).all(1)
        assert same[own].all(), f"the step's own token was read before the wait: {same.tolist()}"
        assert not same[~own].any(), f"the launch did not run ahead of the wait: {same.tolist()}"
