"""Each tensor-parallel layer of model/parallel.py against the unsharded layer, on one device.

Every rank's shard is built in this one process from the unsharded weights, with collectives that leave
each rank's partial result as it is (`PartialCollectives`); each check then combines the ranks' outputs
exactly as the collective would (a sum for the row-parallel projections and the vocabulary-parallel
embedding, a concatenation for the column-parallel projections and the LM head's logits) and compares
with the unsharded layer in fp32. The KV cache and recurrent state each rank writes are compared with
the unsharded ones' heads and channels that rank holds.

`check_relayout` moves a request's KV and state from every rank of one size to every rank of another
the way a decode rank receives them: the exporter's `selected_pieces` picks the heads and channels a
part selects, `PartSink` places them into the decode rank's own blocks and state tensors.

Shared by tests/model/test_tp_shards_cpu.py (the CPU) and tests/gpu/test_tp_shards.py (one CUDA device):
every tensor is made on the `device` given.
"""

from __future__ import annotations

import torch
from torch import nn

from splitserve.engine.tp.kv_routes import Plan, parts
from splitserve.model.attention import AttentionMetadata, PrefillChunk, TorchPagedAttention
from splitserve.model.config import ModelConfig
from splitserve.model.decoder import ForwardContext
from splitserve.model.parallel import kv_head_index, shard_model, state_index
from splitserve.model.random_weights import hf_state_dict, random_model, random_source_config
from splitserve.transport.layout import KVLayout, torch_dtype
from splitserve.transport.part_sink import PartSink
from splitserve.transport.payload import ByteStream, selected_pieces

BLOCK = 16
CHUNKS = ((0, 21), (21, 7))  # (first position, tokens): a prompt, then a chunk that reads its cache
POSITIONS = 256
TOL = {"rtol": 1e-5, "atol": 1e-5}

# the cases both device modules run: (shape, size) per layer, and (prefill size, decode size) per re-layout
DENSE = [("random:tiny", 2), ("random:tiny", 4), ("random:tiny-llama", 2), ("random:tiny-llama", 4)]
ALL = [*DENSE, ("random:qwen3.5-tiny", 2)]
SIZES = [(1, 2), (2, 1), (2, 2), (1, 4), (4, 1), (2, 4), (4, 2)]
HYBRID_SIZES = [(1, 2), (2, 1), (2, 2)]


class PartialCollectives:
    """`Collectives` that leave each rank's partial result unreduced (the check combines the ranks)."""

    def __init__(self, rank: int, size: int) -> None:
        self.rank, self.size = rank, size

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        return x

    def all_gather_last(self, x: torch.Tensor) -> torch.Tensor:
        return x


def build(shape: str, size: int, device: str) -> tuple[nn.Module, list[nn.Module]]:
    """The unsharded random-weight model of `shape` on `device`, and each of `size` ranks' shard."""
    full = random_model(random_source_config(shape), device, torch.float32, POSITIONS, std=0.1).model
    named = hf_state_dict(full)
    dev = torch.device(device)
    return full, [shard_model(full, named, PartialCollectives(r, size), dev, POSITIONS) for r in range(size)]


def _inputs(cfg: ModelConfig, device: str, seed: int = 0) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, cfg.hidden_size, generator=g).to(device) for _, n in CHUNKS]


def _meta(first: int, n: int, device: str, decode: bool = False) -> AttentionMetadata:
    blocks = -(-(first + n) // BLOCK)
    chunk = PrefillChunk(0, n, first + n, torch.arange(blocks, device=device))
    return AttentionMetadata(
        slot_mapping=torch.arange(first, first + n, device=device), num_decode_tokens=n if decode else 0,
        decode_groups=(), prefills=() if decode else (chunk,),
        seq_slots=torch.zeros(1 if not decode else n, dtype=torch.int64, device=device),
    )  # fmt: skip


def _attention_run(model: nn.Module, layer: int, xs: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's attention over the chunks: (outputs [T, hidden], its KV [blocks, 2, bs, KVH, D])."""
    cfg, dev = model.cfg, xs[0].device
    blocks = -(-sum(n for _, n in CHUNKS) // BLOCK)
    kv = torch.zeros((blocks, cfg.num_kv_layers, 2, BLOCK, cfg.num_kv_heads, cfg.head_dim), device=dev)
    attn = model.layers[layer].self_attn
    rope = model.partial_rope if cfg.is_hybrid else model.rope
    outs = []
    for (first, n), x in zip(CHUNKS, xs, strict=True):
        ctx = ForwardContext(TorchPagedAttention(cfg.head_dim**-0.5), _meta(first, n, str(dev)), kv)
        outs.append(attn(torch.arange(first, first + n, device=dev), x, rope, ctx))
    return torch.cat(outs), kv[:, cfg.kv_layer_ids.index(layer)]


@torch.inference_mode()
def check_attention(shape: str, size: int, device: str) -> None:
    """Attention by heads (KV heads replicated below the rank count): o_proj's partials sum to the
    unsharded output, and each rank's cache holds the unsharded cache's heads it owns."""
    full, shards = build(shape, size, device)
    layer = full.cfg.kv_layer_ids[0]
    xs = _inputs(full.cfg, device)
    expected, kv = _attention_run(full, layer, xs)
    partials = [_attention_run(s, layer, xs) for s in shards]
    torch.testing.assert_close(sum(out for out, _ in partials), expected, **TOL)
    for r, (_, rank_kv) in enumerate(partials):
        heads = kv_head_index(full.cfg, size, r)
        torch.testing.assert_close(rank_kv, kv[:, :, :, heads], **TOL)


@torch.inference_mode()
def check_mlp(shape: str, size: int, device: str) -> None:
    """gate_up column-parallel (each rank's rows of the intermediate), down_proj row-parallel (sum)."""
    full, shards = build(shape, size, device)
    x = _inputs(full.cfg, device)[0]
    mlp = full.layers[0].mlp
    gate, up = mlp.gate_up_proj(x).chunk(2, dim=-1)  # [T, I] each
    columns = [s.layers[0].mlp.gate_up_proj(x).chunk(2, dim=-1) for s in shards]
    torch.testing.assert_close(torch.cat([g for g, _ in columns], dim=-1), gate, **TOL)
    torch.testing.assert_close(torch.cat([u for _, u in columns], dim=-1), up, **TOL)
    torch.testing.assert_close(sum(s.layers[0].mlp(x) for s in shards), mlp(x), **TOL)


def _gdn_run(model: nn.Module, layer: int, xs: list[torch.Tensor], fused: bool) -> tuple[torch.Tensor, dict]:
    """A Gated DeltaNet layer over the prompt chunks and one decode row: (outputs, its state slot)."""
    dev = xs[0].device
    gdn = model.layers[layer].linear_attn
    gdn.fused = fused
    states = {n: torch.zeros((1, *s), dtype=d, device=dev) for n, (s, d) in model.state_shapes().items()}
    outs = []
    for (first, n), x in zip(CHUNKS, xs, strict=True):
        outs.append(gdn(x, ForwardContext(TorchPagedAttention(1.0), _meta(first, n, str(dev)), None, states)))
    decode = xs[1][-1:] * 0.5
    outs.append(
        gdn(decode, ForwardContext(TorchPagedAttention(1.0), _meta(28, 1, str(dev), True), None, states))
    )
    return torch.cat(outs), {n: t[0, gdn.index] for n, t in states.items()}


@torch.inference_mode()
def check_gated_deltanet(shape: str, size: int, device: str, fused: bool = False) -> None:
    """Gated DeltaNet by head: out_proj's partials sum to the unsharded output, and each rank's conv
    window and recurrent state are the unsharded ones' channels and value heads it owns."""
    full, shards = build(shape, size, device)
    layer = full.cfg.layer_types.index("linear_attention")
    xs = _inputs(full.cfg, device)
    expected, state = _gdn_run(full, layer, xs, fused)
    partials = [_gdn_run(s, layer, xs, fused) for s in shards]
    torch.testing.assert_close(sum(out for out, _ in partials), expected, **TOL)
    for r, (_, rank_state) in enumerate(partials):
        for name, (axis, channels, _) in state_index(full.cfg, size, r).items():
            held = state[name].index_select(axis - 1, torch.tensor(channels, device=device))  # no layer axis
            torch.testing.assert_close(rank_state[name], held, **TOL)


@torch.inference_mode()
def check_vocab_parallel(shape: str, size: int, device: str) -> None:
    """The embedding's partials (zeros for ids a rank does not hold) sum to the unsharded lookup, and
    the LM head's logits, concatenated in rank order (padding cut), are the unsharded logits."""
    full, shards = build(shape, size, device)
    vocab = full.cfg.vocab_size
    ids = torch.cat([torch.arange(vocab), torch.tensor([0, vocab - 1, vocab // 2])]).to(device)
    torch.testing.assert_close(
        sum(s.embed_tokens(ids) for s in shards), full.embed_tokens(ids), rtol=0, atol=0
    )
    hidden = _inputs(full.cfg, device)[0]
    logits = torch.cat([s.compute_logits(hidden) for s in shards], dim=-1)[:, :vocab]
    torch.testing.assert_close(logits, full.compute_logits(hidden), **TOL)


def _layout(cfg: ModelConfig, full: nn.Module) -> KVLayout:
    states = tuple((n, s, str(d).removeprefix("torch.")) for n, (s, d) in full.state_shapes().items())
    return KVLayout("tp-shards", "float32", BLOCK, cfg.num_kv_layers, cfg.num_kv_heads, cfg.head_dim, states)


@torch.inference_mode()
def check_relayout(shape: str, prefill_size: int, decode_size: int, device: str) -> None:
    """A request's KV and state from a replica at `prefill_size` to one at `decode_size`: each decode
    rank fetches each of its parts from the prefill rank holding it into its own blocks (other block
    ids than the exporter's, out of order) and state, and holds exactly its heads and channels."""
    full = random_model(random_source_config(shape), "cpu", torch.float32, POSITIONS).model
    cfg, layout = full.cfg, _layout(full.cfg, full)
    g = torch.Generator().manual_seed(3)
    kv = torch.randn((8, *layout.block_shape), generator=g).to(device)  # the unsharded cache
    state = {n: torch.randn(s, generator=g).to(device) for n, s, _ in layout.state_shapes}
    src_ids, dst_ids = [6, 2, 3, 7], [1, 5, 4, 0]
    plan = Plan.build(cfg, prefill_size, decode_size)
    src = [_rank_tensors(plan, "src", r, kv, state, device) for r in range(prefill_size)]
    for d in range(decode_size):
        rank_layout = plan.dst.rank_layout(layout, d)
        rank_kv = torch.zeros((8, *rank_layout.block_shape), device=device)
        rank_state = {
            n: torch.zeros(s, dtype=torch_dtype(t), device=device) for n, s, t in rank_layout.state_shapes
        }
        for part in parts(plan, d):
            src_kv, src_state = src[part.src]
            sent = ByteStream(
                selected_pieces(
                    src_kv, plan.src.rank_layout(layout, part.src), src_ids, src_state, part.select
                )
            )
            sink = PartSink(rank_kv, rank_layout, dst_ids, part.heads, rank_state, part.states)
            ByteStream(sink.pieces).copy_stream(sent)
            sink.commit()
        want_kv, want_state = _rank_tensors(plan, "dst", d, kv, state, device)
        assert torch.equal(rank_kv[dst_ids], want_kv[src_ids]), f"decode rank {d}'s KV heads"
        for name, t in rank_state.items():
            assert torch.equal(t, want_state[name]), f"decode rank {d}'s {name} channels"


def _rank_tensors(plan: Plan, side: str, rank: int, kv: torch.Tensor, state: dict, device: str) -> tuple:
    """One rank's share of the unsharded cache and state: (kv [8, L, 2, bs, its heads, D], state)."""
    sharding = plan.src if side == "src" else plan.dst
    heads = torch.tensor(sharding.kv[rank], device=device)
    own = {}
    for name, t in state.items():
        axis, channels, _ = sharding.states[name]
        own[name] = t.index_select(axis, torch.tensor(channels[rank], device=device)).contiguous()
    return kv.index_select(4, heads).contiguous(), own
