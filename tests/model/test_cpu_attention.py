"""The CPU paged decode op (kernels/cpu/attention.py) and the fresh-prompt prefill path against the
gather + SDPA reference of TorchPagedAttention."""

from __future__ import annotations

import pytest
import torch

from splitserve.kernels.cpu import attention as cpu_attention
from splitserve.model.attention import AttentionMetadata, DecodeGroup, PrefillChunk, TorchPagedAttention

BS, LAYERS = 4, 2


def _tables(lens: list[int], num_blocks: int, seed: int = 1, bs: int = BS) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    table = torch.zeros((len(lens), max(-(-n // bs) for n in lens) + 1), dtype=torch.int64)  # + padding
    for i, n in enumerate(lens):
        for j in range(-(-n // bs)):
            table[i, j] = perm.pop()
    return table


@pytest.fixture(scope="module")
def op() -> object:
    """The op, built here whether or not SPLITSERVE_CPU_ATTN turns it on for engines (once per host:
    torch caches the build)."""
    built = cpu_attention.load(force=True)
    if built is None:
        pytest.skip("the CPU op could not be built here (no C++ compiler or ninja)")
    return built


@pytest.mark.parametrize(("kvh", "h", "d"), [(3, 9, 64), (2, 2, 16), (1, 4, 12)])
def test_paged_decode_matches_gather_sdpa(op: object, kvh: int, h: int, d: int) -> None:
    lens = [1, 5, 17, 30, 4]
    gen = torch.Generator().manual_seed(0)
    kv = torch.randn((60, LAYERS, 2, BS, kvh, d), generator=gen)
    tables = _tables(lens, 60)
    q = torch.randn(len(lens), h, d, generator=gen)
    group = DecodeGroup(0, len(lens), tables, torch.tensor(lens))
    ref = TorchPagedAttention(d**-0.5)._decode(q, kv[:, 1, 0], kv[:, 1, 1], group)
    out = cpu_attention.paged_decode(q, kv[:, 1, 0], kv[:, 1, 1], tables, torch.tensor(lens), d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(("kvh", "h", "d"), [(3, 9, 64), (2, 4, 128), (1, 2, 24), (2, 2, 20)])
def test_paged_decode_in_blocks_of_16(op: object, kvh: int, h: int, d: int) -> None:
    """Blocks of 16 (the engine's): the op scores 8 rows of a block at a time where head_dim allows (a
    multiple of 8), one at a time for the rest of a block and for other head sizes."""
    lens = [1, 8, 16, 17, 23, 40, 100]
    gen = torch.Generator().manual_seed(4)
    kv = torch.randn((60, LAYERS, 2, 16, kvh, d), generator=gen)
    tables = _tables(lens, 60, seed=5, bs=16)
    q = torch.randn(len(lens), h, d, generator=gen)
    group = DecodeGroup(0, len(lens), tables, torch.tensor(lens))
    ref = TorchPagedAttention(d**-0.5)._decode(q, kv[:, 0, 0], kv[:, 0, 1], group)
    out = cpu_attention.paged_decode(q, kv[:, 0, 0], kv[:, 0, 1], tables, torch.tensor(lens), d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("bs", [4, 16, 32])
@pytest.mark.parametrize(
    ("kvh", "g", "d"), [(3, 3, 64), (1, 1, 64), (2, 7, 64), (1, 13, 64), (2, 2, 128), (1, 8, 128)]
)
@pytest.mark.parametrize("rows", [2, 9])
def test_paged_decode_head_groups_block_sizes_and_task_splits(
    op: object, bs: int, kvh: int, g: int, d: int, rows: int
) -> None:
    """The AVX-512 body's shapes (kernels/cpu/attention_avx512.py, where the host has it; the AVX2 body
    elsewhere): head_dim 64 and 128; G query heads a KV head taken in passes of up to 6 (64) or 3 (128);
    blocks shorter than, equal to and longer than its 16 rows a score pass, and partial last blocks;
    2 rows (a task a KV head) and 9 (a task a sequence)."""
    lens = [1, 15, 16, 33, 47, 64, 100, 5, 260][:rows]
    gen = torch.Generator().manual_seed(bs * 100 + g * 10 + d)
    nb = sum(-(-n // bs) for n in lens) + 4
    kv = torch.randn((nb, 1, 2, bs, kvh, d), generator=gen)
    tables = _tables(lens, nb, seed=bs, bs=bs)
    q = torch.randn(len(lens), kvh * g, d, generator=gen)
    group = DecodeGroup(0, len(lens), tables, torch.tensor(lens))
    ref = TorchPagedAttention(d**-0.5)._decode(q, kv[:, 0, 0], kv[:, 0, 1], group)
    out = cpu_attention.paged_decode(q, kv[:, 0, 0], kv[:, 0, 1], tables, torch.tensor(lens), d**-0.5)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_the_avx512_body_runs_where_the_host_has_it(op: object) -> None:
    """The cases above pass with either body; this counts the tasks the AVX-512 body ran: head_dim 64
    and 128 on hosts where torch reports AVX-512 (unless SPLITSERVE_CPU_ATTN_AVX512=0), never 96."""
    count = torch.ops.splitserve_cpu.paged_decode_tasks512
    lens = [5, 17, 30]
    wide = cpu_attention._AVX512  # torch reports AVX-512 here and the switch leaves it on
    for d, taken in ((64, wide), (128, wide), (96, False)):
        kv = torch.randn((30, 2, BS, 2, d))
        q = torch.randn(len(lens), 4, d)
        before = count()
        cpu_attention.paged_decode(q, kv[:, 0], kv[:, 1], _tables(lens, 30), torch.tensor(lens), d**-0.5)
        assert (count() > before) == taken, d


@pytest.mark.parametrize("kernel", [True, False])
def test_forward_decode_and_prefill(kernel: bool, request: pytest.FixtureRequest) -> None:
    """A step with two decode rows, a fresh prompt and a later chunk: forward() against the reference
    methods (the op on or off; the fresh prompt attends over its own K/V without a gather). With the op
    on, a host that cannot build it skips (the `op` fixture) instead of testing the torch path twice."""
    if kernel:
        request.getfixturevalue("op")
    kvh, h, d = 3, 9, 64
    gen = torch.Generator().manual_seed(2)
    kv = torch.randn((40, LAYERS, 2, BS, kvh, d), generator=gen)
    tables = _tables([9, 6, 11, 16], 40, seed=3)
    # rows: decode 0 (ctx 9), decode 1 (ctx 6), fresh prompt of 11, a chunk of 7 after 9 cached tokens
    lens = [(9, 1), (6, 1), (11, 11), (16, 7)]
    slots = []
    for i, (ctx, n) in enumerate(lens):
        for pos in range(ctx - n, ctx):
            slots.append(int(tables[i, pos // BS]) * BS + pos % BS)
    t = len(slots)
    q, k, v = (torch.randn(t, x, d, generator=gen) for x in (h, kvh, kvh))
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots),
        num_decode_tokens=2,
        decode_groups=(DecodeGroup(0, 2, tables[:2], torch.tensor([9, 6])),),
        prefills=(PrefillChunk(2, 11, 11, tables[2, :3]), PrefillChunk(13, 7, 16, tables[3, :4])),
    )
    attn = TorchPagedAttention(d**-0.5)
    attn.cpu_kernel = kernel
    out = attn.forward(1, q, k, v, kv, meta).view(t, h, d)
    kc, vc = kv[:, 1, 0], kv[:, 1, 1]  # forward stored this step's K/V there
    ref = torch.cat([
        attn._decode(q[:2], kc, vc, meta.decode_groups[0]),
        attn._prefill(q[2:13], kc, vc, meta.prefills[0]),
        attn._prefill(q[13:], kc, vc, meta.prefills[1]),
    ])  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-6)


def test_build_is_cached_and_start_is_a_noop_when_built(op: object) -> None:
    """A second build answers the cached library; with the op loaded, `start()` starts no thread."""
    first = cpu_attention.LIB.build()
    assert cpu_attention.LIB.build() == first and first.exists()
    assert cpu_attention.ready()
    before = cpu_attention.LIB.thread
    cpu_attention.start()
    assert cpu_attention.LIB.thread is before
