"""The Triton paged-attention kernels against the plain-torch backend, on CPU under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from splitserve.kernels.paged_attention import (  # noqa: E402
    decode_num_splits,
    paged_decode_attention,
    paged_prefill_attention,
)
from splitserve.model.attention import (  # noqa: E402
    AttentionMetadata,
    DecodeGroup,
    PrefillChunk,
    TorchPagedAttention,
)

BS, LAYERS, KVH, H, D = 4, 2, 2, 4, 16


def _cache(num_blocks: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn((num_blocks, LAYERS, 2, BS, KVH, D), generator=gen)


def _tables(lens: list[int], num_blocks: int, seed: int = 1) -> torch.Tensor:
    """Disjoint random blocks per sequence, padded with zeros."""
    gen = torch.Generator().manual_seed(seed)
    perm = torch.randperm(num_blocks, generator=gen).tolist()
    width = max(-(-n // BS) for n in lens)
    table = torch.zeros((len(lens), width), dtype=torch.int64)
    for i, n in enumerate(lens):
        for j in range(-(-n // BS)):
            table[i, j] = perm.pop()
    return table


@pytest.mark.parametrize(("splits", "fresh"), [(1, 1), (3, 1), (1, 5), (3, 5), (3, 17)])
def test_decode_matches_torch(splits: int, fresh: int) -> None:
    """`fresh` > 1 (a verify chunk's rows: their chunk's last tokens read after the PDL wait) reads the
    same tokens, whatever tiles they fall in (BLOCK_N is 16 under the interpreter)."""
    lens = [1, 5, 17, 30]
    kv = _cache(40)
    tables = _tables(lens, 40)
    q = torch.randn(len(lens), H, D)
    layer = 1
    ref_meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64),
        num_decode_tokens=len(lens),
        decode_groups=(DecodeGroup(0, len(lens), tables, torch.tensor(lens)),),
        prefills=(),
    )
    ref = TorchPagedAttention(D**-0.5)._decode(q, kv[:, layer, 0], kv[:, layer, 1], ref_meta.decode_groups[0])
    out = paged_decode_attention(
        q, kv[:, layer, 0], kv[:, layer, 1], tables, torch.tensor(lens), D**-0.5, num_splits=splits,
        fresh=fresh,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_prefill_chunks_and_prefix_match_torch() -> None:
    """Two chunks in one launch: a whole prompt, and a later chunk of a sequence with 9 cached tokens."""
    kv = _cache(40, seed=2)
    chunks = [(0, 11, 11), (11, 7, 16)]  # (query_start, query_len, context_len)
    tables = _tables([11, 16], 40, seed=3)
    q = torch.randn(18, H, D)
    layer = 0
    attn = TorchPagedAttention(D**-0.5)
    ref = torch.empty_like(q)
    for i, (start, n, ctx) in enumerate(chunks):
        chunk = PrefillChunk(start, n, ctx, tables[i, : -(-ctx // BS)])
        ref[start : start + n] = attn._prefill(q[start : start + n], kv[:, layer, 0], kv[:, layer, 1], chunk)
    out = torch.zeros_like(q)
    col = list(zip(*chunks, strict=True))
    paged_prefill_attention(
        q, kv[:, layer, 0], kv[:, layer, 1], out, tables,
        torch.tensor(col[0]), torch.tensor(col[1]), torch.tensor(col[2]), max(col[1]), D**-0.5,
    )  # fmt: skip
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


def test_num_splits() -> None:
    assert decode_num_splits(1, 8, 576) == 4  # few programs: split, but keep >= 128 tokens a split
    assert decode_num_splits(1, 8, 4096) == 16
    assert decode_num_splits(128, 8, 4096) == 1  # 1024 programs already fill the GPU


def test_fresh_chunk_goes_to_sdpa_over_its_blocks(monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's one prefill chunk with no cached context, after two decode rows: the backend attends it
    with torch's fused attention over the K/V read back from its (shuffled) blocks, equal to the paged
    kernel; a chunk with cached context, or a short one, stays on the paged kernel."""
    from splitserve.model import attention
    from splitserve.model.attention import PrefillBatch, TritonPagedAttention

    monkeypatch.setattr(attention, "FRESH_SDPA_MIN", 8)
    kv = _cache(40, seed=4)
    n, layer = 13, 1
    tables = _tables([n], 40, seed=5)
    q = torch.randn(2 + n, H, D)
    chunk = PrefillChunk(2, n, n, None)
    one = torch.tensor([2]), torch.tensor([n]), torch.tensor([n])
    meta = AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64), num_decode_tokens=0, decode_groups=(),
        prefills=(chunk,), prefill_batch=PrefillBatch(*one, tables, n),
    )  # fmt: skip
    assert attention._sole_fresh_chunk(meta) is chunk
    out = torch.zeros(2 + n, H, D)
    attention._attend_fresh_chunk(q, kv[:, layer, 0], kv[:, layer, 1], tables[0], chunk, D**-0.5, out)
    want = torch.zeros_like(q)
    paged_prefill_attention(q, kv[:, layer, 0], kv[:, layer, 1], want, tables, *one, n, D**-0.5)
    torch.testing.assert_close(out, want, rtol=1e-5, atol=1e-5)
    got = TritonPagedAttention(D**-0.5).attend(layer, q, kv, meta).view(2 + n, H, D)
    torch.testing.assert_close(got[2:], want[2:], rtol=1e-5, atol=1e-5)
    cached = AttentionMetadata(
        slot_mapping=meta.slot_mapping, num_decode_tokens=0, decode_groups=(),
        prefills=(PrefillChunk(2, n, n + 3, None),), prefill_batch=meta.prefill_batch,
    )  # fmt: skip
    assert attention._sole_fresh_chunk(cached) is None
    monkeypatch.setattr(attention, "FRESH_SDPA_MIN", n + 1)
    assert attention._sole_fresh_chunk(meta) is None
