"""kernels/cpu/amx.py: a block-quantized weight's products on AMX are as exact as fp32's, its blocks are
recovered bit for bit from the dequantized weights (and only from them), and greedy output through it
stays token-exact with HF on the embedded Q4_1 GGUF. The products run where the host has AMX-BF16
(Intel Xeon 4th generation and later) and skip elsewhere, saying so; the recovery is plain torch and
runs everywhere."""

from __future__ import annotations

import pytest
import torch

from splitserve import SamplingParams
from splitserve.kernels.cpu import amx as cpu_amx
from splitserve.model.layers import Linear


@pytest.fixture(scope="module")
def amx() -> None:
    if not cpu_amx.supported():
        pytest.skip("no AMX-BF16 on this host")
    if not cpu_amx.load(force=True):
        pytest.skip("the AMX op did not build or the kernel refused the tile state")


def _q4_1(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """A weight as a Q4_1 GGUF dequantizes: fp16 d and m per 32 inputs, codes 0..15 with 0 and 15 in
    every block (the quantizer maps a block's least and largest weights there)."""
    q = torch.randint(0, 16, (n, k), generator=gen).float()
    q[:, ::32], q[:, 1::32] = 0, 15
    d = (torch.rand(n, k // 32, generator=gen) * 0.02 + 1e-3).half().float()
    m = (-torch.rand(n, k // 32, generator=gen) * 0.15).half().float()
    return q * d.repeat_interleave(32, 1) + m.repeat_interleave(32, 1)


def _q8_0(n: int, k: int, gen: torch.Generator) -> torch.Tensor:
    q = torch.randint(-127, 128, (n, k), generator=gen).float()
    q[:, ::32] = 127
    d = (torch.rand(n, k // 32, generator=gen) * 1e-3 + 1e-5).half().float()
    return q * d.repeat_interleave(32, 1)


@pytest.mark.parametrize("fmt", ["q4_1", "q8_0"])
@pytest.mark.parametrize("rows", [1, 17, 64, 300])
def test_products_are_as_exact_as_fp32(amx, fmt: str, rows: int) -> None:
    gen = torch.Generator().manual_seed(rows)
    n, k = (96, 576) if fmt == "q4_1" else (64, 1536)
    w = (_q4_1 if fmt == "q4_1" else _q8_0)(n, k, gen)
    blocks = cpu_amx.blocks(w)
    assert blocks is not None and (blocks.m is None) == (fmt == "q8_0")
    x = torch.randn(rows, k, generator=gen) * torch.logspace(-3, 2, k)  # inputs over five decades
    bias = torch.randn(n, generator=gen)
    ref = x.double() @ w.double().t() + bias.double()
    got = cpu_amx.matmul(x.view(1, rows, k), blocks, bias)
    assert got.shape == (1, rows, n) and got.dtype == torch.float32
    fp32 = torch.nn.functional.linear(x, w, bias)
    scale = ref.abs().max()
    err, err32 = [float((y.reshape(rows, n).double() - ref).abs().max() / scale) for y in (got, fp32)]
    assert err < max(2 * err32, 1e-6), (err, err32)


def test_only_weights_that_blocks_reproduce_bit_for_bit_are_taken() -> None:
    gen = torch.Generator().manual_seed(0)
    w = _q4_1(64, 128, gen)
    assert cpu_amx.blocks(w) is not None
    off = w.clone()
    off[3, 5] = torch.nextafter(off[3, 5], torch.tensor(1.0))  # one weight one ulp away
    assert cpu_amx.blocks(off) is None
    assert cpu_amx.blocks(torch.randn(64, 128, generator=gen)) is None  # random fp32 (the parity tests')
    assert cpu_amx.blocks(_q4_1(48, 128, gen)) is None  # N not a multiple of 32
    assert cpu_amx.blocks(w.double()) is None


def test_the_embedded_models_weights_are_all_recovered(smol_loaded) -> None:
    model = smol_loaded.model
    linears = [m.weight for m in model.modules() if isinstance(m, Linear)]
    assert linears and all(cpu_amx.blocks(w) is not None for w in linears)  # Q4_1
    head = cpu_amx.blocks(model.embed_tokens.weight)  # the tied Q8_0 embedding
    assert head is not None and head.m is None


def test_greedy_through_amx_matches_hf(
    amx, make_smol_llm, chat_prompt_ids, hf_smol_greedy, monkeypatch
) -> None:
    monkeypatch.setattr(cpu_amx, "MIN_ROWS", 1)  # every product: prompts, decode rows, the LM head
    llm = make_smol_llm()  # builds its model's CPU products (cpu_linear.prepare_model) anew
    model = llm.engine.loaded.model
    assert model.layers[0].mlp.down_proj.cpu_matmul.takes_amx(1)
    assert model.cpu_lm_head.takes_amx(1)
    calls = []
    real = cpu_amx.matmul
    monkeypatch.setattr(cpu_amx, "matmul", lambda *a: calls.append(1) or real(*a))
    greedy = SamplingParams(temperature=0, max_tokens=64)
    outs = llm.generate([{"prompt_token_ids": p} for p in chat_prompt_ids], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == hf_smol_greedy
    assert len(calls) > 1000  # 4 a layer a step, and the head
