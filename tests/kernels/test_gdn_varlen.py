"""The varlen prefill path of the Gated DeltaNet layers (model/gdn_prefill.py) on CPU: the varlen causal
conv kernels (kernels/causal_conv_varlen.py) under Triton's interpreter against the per-chunk torch
conv, and GatedDeltaNet.forward and the whole engine with the varlen path on, its rule replaced by
`torch_varlen_rule` (fla's kernels do not run under the interpreter; tests/gpu checks fla itself), so
the plumbing is checked here: one cu_seqlens per step, states gathered from and scattered back to
shuffled slots, chunks shorter than the conv window, decode rows in front."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from gdn_meta import prefill_meta  # noqa: E402
from tiny_configs import TINY_QWEN3_5  # noqa: E402

from splitserve.kernels.causal_conv_varlen import (  # noqa: E402
    causal_conv1d_varlen,
    causal_conv1d_varlen_split,
    conv1d_varlen_update_states,
)
from splitserve.model import gdn_layer, gdn_prefill, qwen3_5  # noqa: E402
from splitserve.model.config import ModelConfig  # noqa: E402
from splitserve.model.decoder import ForwardContext  # noqa: E402

LENS = (1, 2, 9, 70)  # shorter than the conv window (K - 1 = 3), and across a 64-token chunk


pytestmark = pytest.mark.usefixtures("one_torch_thread")  # tests/conftest.py


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_conv_varlen_matches_per_chunk(dtype: torch.dtype):
    gen = torch.Generator().manual_seed(0)
    c, kw, slots = 40, 4, torch.tensor([5, 0, 3, 2])
    x_full = torch.randn(sum(LENS), c + 8, generator=gen).to(dtype)
    x = x_full[:, 4 : 4 + c]  # a strided view, as the in_proj split gives
    pool = torch.randn(6, 2, c, kw - 1, generator=gen).to(dtype).float()[:, 1]  # one layer of a pool
    ref_pool = pool.clone()
    weight = (torch.randn(c, 1, kw, generator=gen) * 0.5).to(dtype)
    meta = prefill_meta(0, LENS, slots)
    lp = gdn_prefill.build_linear_prefill(meta, torch.device("cpu"))
    assert lp is not None and lp.cu_seqlens.tolist() == [0, 1, 3, 12, 82]

    out = torch.full((sum(LENS), c), float("nan"), dtype=dtype)
    causal_conv1d_varlen(x, pool, weight, lp.cu_seqlens, lp.token_seq, lp.slots, out=out)
    # the same output split at the q | k | v channels (8 | 8 | 24) into contiguous tensors
    split = causal_conv1d_varlen_split(x, pool, weight, lp.cu_seqlens, lp.token_seq, lp.slots, 8)
    assert all(p.is_contiguous() for p in split) and [p.shape[1] for p in split] == [8, 8, 24]
    assert torch.equal(torch.cat(split, dim=1), out)
    conv1d_varlen_update_states(x, pool, lp.cu_seqlens, lp.slots)

    start = 0
    for n, slot in zip(LENS, slots.tolist(), strict=True):  # GatedDeltaNet.forward's torch prefill conv
        seq = torch.cat([ref_pool[slot].to(dtype), x[start : start + n].T], dim=-1)  # [C, K - 1 + n]
        ref = F.silu(F.conv1d(seq[None], weight, groups=c))[0].T
        tol = dict(rtol=0, atol=0) if dtype == torch.bfloat16 else dict(rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(out[start : start + n], ref, **tol)
        ref_pool[slot] = seq[:, -(kw - 1) :].float()
        start += n
    assert torch.equal(pool, ref_pool)  # the windows, and the untouched slots 1 and 4


def _layer_and_states(cfg: ModelConfig):
    torch.manual_seed(0)
    layer = qwen3_5.GatedDeltaNet(cfg, 1).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn_like(p) * 0.2)
    lin = cfg.linear
    assert lin is not None
    gen = torch.Generator().manual_seed(5)
    shapes = {
        "conv": (8, 3, lin.conv_dim, lin.conv_kernel - 1),
        "recurrent": (8, 3, lin.num_value_heads, lin.key_head_dim, lin.value_head_dim),
    }
    return layer, {name: torch.randn(s, generator=gen) * 0.2 for name, s in shapes.items()}


def test_gated_delta_net_varlen_matches_per_chunk(monkeypatch):
    cfg = ModelConfig.from_hf(
        {**TINY_QWEN3_5, "model_type": "qwen3_5_text", "architectures": ["Qwen3_5ForCausalLM"]}
    )
    layer, states = _layer_and_states(cfg)
    ref_states = {name: s.clone() for name, s in states.items()}
    nd = 2
    meta = prefill_meta(nd, LENS, torch.tensor([6, 1, 3, 0, 7, 4]))  # 2 decode rows, then 4 chunks
    x = torch.randn(nd + sum(LENS), cfg.hidden_size, generator=torch.Generator().manual_seed(2))

    with torch.no_grad():
        ref = layer(x, ForwardContext(attn=None, meta=meta, kv_cache=torch.empty(0), states=ref_states))
        monkeypatch.setattr(gdn_prefill, "VARLEN_RULE", gdn_prefill.torch_varlen_rule)
        layer.varlen = True
        lp = gdn_prefill.build_linear_prefill(meta, x.device)
        ctx = ForwardContext(attn=None, meta=meta, kv_cache=torch.empty(0), states=states, linear_prefill=lp)
        out = layer(x, ctx)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    for name in states:
        torch.testing.assert_close(states[name], ref_states[name], rtol=1e-5, atol=1e-5)


def test_engine_varlen_greedy_matches_torch(monkeypatch, tmp_path):
    """The engine with linear_attention_backend=fla (the torch stand-in rule): the same greedy tokens as
    the torch backend, with prompts split into chunks mid-prompt and a preemption."""
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    from splitserve import SamplingParams
    from splitserve.config.engine import EngineConfig
    from splitserve.engine.config import block_bytes
    from splitserve.engine.engine import LLMEngine
    from splitserve.engine.llm import LLM
    from splitserve.model.loader import LoadedModel

    torch.manual_seed(1)
    hf = Qwen3_5ForCausalLM(Qwen3_5TextConfig(**TINY_QWEN3_5)).eval()
    cfg = ModelConfig.from_hf({**hf.config.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]})
    hf.save_pretrained(tmp_path)
    with torch.device("meta"):
        model = qwen3_5.Qwen3_5LM(cfg, 256)
    model = model.to_empty(device="cpu")
    model.load_weights(hf.state_dict().items())
    loaded = LoadedModel(model.eval(), cfg, None, 0.0)
    gen = torch.Generator().manual_seed(1)
    # every prompt but the first spans two or more 13-token steps (a chunk carries the conv and recurrent
    # states into the next), and 10 blocks of 16 tokens cannot hold all four answers: one is preempted
    prompts = [torch.randint(0, 512, (n,), generator=gen).tolist() for n in (3, 17, 30, 20)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)

    def run(backend: str) -> tuple[list[list[int]], int]:
        config = EngineConfig(
            model=str(tmp_path), device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8,
            max_num_batched_tokens=13, kv_cache_bytes=10 * block_bytes(cfg, 16, torch.float32),
            linear_attention_backend=backend, progress=False,
        )  # fmt: skip
        llm = LLM.from_engine(LLMEngine(config, tokenizer=None, loaded=loaded))
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        return [o.outputs[0].token_ids for o in outs], llm.engine.scheduler.num_preemptions

    ref, _ = run("torch")
    monkeypatch.setattr(gdn_prefill, "VARLEN_RULE", gdn_prefill.torch_varlen_rule)
    calls = []
    real = gdn_prefill.varlen_rule
    monkeypatch.setattr(gdn_layer, "varlen_rule", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    got, preemptions = run("fla")
    assert calls and preemptions > 0
    assert got == ref


def test_the_chunk_table_lists_each_sequences_chunks_in_order(monkeypatch: pytest.MonkeyPatch) -> None:
    lens = (1, 64, 65, 200, 128)
    expected = [(i, j) for i, n in enumerate(lens) for j in range(-(-n // gdn_prefill.CHUNK))]
    monkeypatch.setattr(gdn_prefill, "fla_rule", lambda: object())  # as where fla imports
    monkeypatch.setattr(gdn_prefill, "VARLEN_RULE", None)
    lp = gdn_prefill.build_linear_prefill(prefill_meta(2, lens, torch.arange(7)), torch.device("cpu"))
    assert lp is not None and lp.chunk_indices is not None
    assert lp.chunk_indices.tolist() == [list(r) for r in expected]
    assert lp.cu_seqlens.tolist() == [0, 1, 65, 130, 330, 458] and lp.token_seq.dtype == torch.int32
