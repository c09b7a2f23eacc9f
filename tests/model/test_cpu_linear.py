"""CPU projections (kernels/cpu/linear.py): the same products as the plain paths."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from splitserve.kernels.cpu import linear as cpu_linear
from splitserve.model.layers import Linear


def test_onednn_matches_f_linear_for_every_batch():
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(96, 64, generator=gen), torch.randn(96, generator=gen)
    mm = cpu_linear.OneDNNMatmul(w, b)
    for rows in (1, 3, 32, 257):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(mm(x), F.linear(x, w, b), rtol=1e-5, atol=1e-5)
    x3 = torch.randn(2, 5, 64, generator=gen)
    torch.testing.assert_close(mm(x3), F.linear(x3, w, b), rtol=1e-5, atol=1e-5)


def test_int4_recovers_q4_1_codes_exactly():
    gen = torch.Generator().manual_seed(1)
    n, k = 48, 128
    q = torch.randint(0, 16, (n, k // 32, 32), generator=gen).float()
    q[..., 0], q[..., 1] = 0, 15  # a Q4_1 block spans its whole range
    d = torch.rand(n, k // 32, 1, generator=gen) * 0.01 + 1e-3
    m = -torch.rand(n, k // 32, 1, generator=gen) * 0.05
    w = (q * d + m).view(n, k)  # what the GGUF loader dequantizes a Q4_1 tensor to
    mm = cpu_linear.Int4Matmul(w, None)
    assert mm.err < 1e-6
    x = torch.randn(4, k, generator=gen)
    ref = F.linear(x.bfloat16().float(), w)
    torch.testing.assert_close(mm(x), ref, rtol=2e-2, atol=2e-2)  # bf16 activations and scales


def test_int4_batches_take_the_same_weights_in_bf16(monkeypatch):
    """From INT4_BF16_ROWS rows the int4 option multiplies the int4 kernel's own dequantized weights,
    rounded to bf16, through oneDNN: its rows match the kernel's at bf16 precision, and the LM head's
    int8 rows the same."""
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(64, 128, generator=gen) * 0.05
    mm, head = cpu_linear.Int4Matmul(w, None), cpu_linear.Int8Matmul(w)
    x = torch.randn(5, 128, generator=gen)
    monkeypatch.setattr(cpu_linear, "INT4_BF16_ROWS", 5)
    fast = [mm(x), head(x)]
    monkeypatch.setattr(cpu_linear, "INT4_BF16_ROWS", 1 << 20)
    kernels = [mm(x), head(x)]
    for a, b in zip(fast, kernels, strict=True):
        assert not torch.equal(a, b)  # another path was taken
        torch.testing.assert_close(a, b, rtol=2e-2, atol=2e-2)


@pytest.fixture
def no_panels(monkeypatch):
    """Projections without kernels/cpu/gemm.py's op (oneDNN and MKL only), whatever this host is."""
    monkeypatch.setattr(cpu_linear.cpu_gemm, "start", lambda: False)


def test_prepare_and_unprepare_model(monkeypatch, no_panels):
    monkeypatch.setenv("SPLITSERVE_CPU_GEMV", "0")  # oneDNN for every batch, whatever this host is
    model = torch.nn.Sequential(Linear(64, 32), Linear(32, 16, bias=False))
    x = torch.randn(3, 64)
    ref = model(x)
    assert cpu_linear.prepare_model(model, "fp32") == {"onednn": 2}
    torch.testing.assert_close(model(x), ref, rtol=1e-5, atol=1e-5)
    assert cpu_linear.prepare_model(model, "int4") == {"int4": 2}
    assert model[0].cpu_matmul is not None
    cpu_linear.unprepare_model(model)
    assert torch.equal(model(x), ref)
    with pytest.raises(ValueError, match="cpu_weights"):
        cpu_linear.prepare_model(model, "int3")


def test_drop_dense_frees_the_shared_buffer_and_keeps_the_products(monkeypatch, no_panels):
    """drop_dense: the packed projections still give the same products; their dense weights are meta;
    every other parameter (here a norm-like vector) no longer views the load's flat buffer."""
    from splitserve.model.weight_cache_entry import assign_parameters

    monkeypatch.setenv("SPLITSERVE_CPU_GEMV", "0")

    model = torch.nn.Sequential(Linear(64, 32), Linear(32, 16, bias=False))
    model.register_parameter("scale", torch.nn.Parameter(torch.randn(16), requires_grad=False))
    names = [n for n, _ in model.named_parameters()]
    flat = torch.cat([p.detach().flatten() for _, p in model.named_parameters()])
    views, at = {}, 0
    for name, p in model.named_parameters():  # the loader's layout: every parameter views one buffer
        views[name] = flat[at : at + p.numel()].view(p.shape)
        at += p.numel()
    assign_parameters(model, views)
    x = torch.randn(3, 64)
    ref = model(x) * model.scale
    cpu_linear.prepare_model(model, "fp32")
    dropped = cpu_linear.drop_dense(model)
    assert dropped == (64 * 32 + 32 * 16) * 4
    assert model[0].weight.is_meta and model[1].weight.is_meta and model[0].weight.shape == (32, 64)
    base = flat.untyped_storage().data_ptr()
    for name, p in model.named_parameters():
        if not p.is_meta:
            assert p.untyped_storage().data_ptr() != base, name
    assert model[0].cpu_matmul.bias is model[0].bias
    torch.testing.assert_close(model(x) * model.scale, ref, rtol=1e-5, atol=1e-5)
    assert sorted(n for n, _ in model.named_parameters()) == sorted(names)
    with pytest.raises(RuntimeError, match="dropped"):
        cpu_linear.unprepare_model(model)


def test_gemv_rows_read_the_dense_weight_and_keep_it(monkeypatch, no_panels):
    """With the MKL GEMV on (Intel's default), one or two rows go through F.linear on the dense weight,
    more through the packed one; drop_dense then drops nothing and leaves the weights where they were."""
    monkeypatch.setenv("SPLITSERVE_CPU_GEMV", "1")
    gen = torch.Generator().manual_seed(2)
    model = torch.nn.Sequential(Linear(64, 32), Linear(32, 16, bias=False))
    weight = model[0].weight
    assert cpu_linear.prepare_model(model, "fp32") == {"onednn + MKL gemv": 2}
    assert model[0].cpu_matmul.dense is weight
    for rows in (1, 2):
        x = torch.randn(rows, 64, generator=gen)
        assert torch.equal(model[0](x), F.linear(x, weight, model[0].bias))
    x = torch.randn(5, 64, generator=gen)
    torch.testing.assert_close(model[0](x), F.linear(x, weight, model[0].bias), rtol=1e-5, atol=1e-5)
    assert cpu_linear.drop_dense(model) == 0 and model[0].weight is weight
    monkeypatch.setenv("SPLITSERVE_CPU_GEMV", "0")
    assert not cpu_linear.gemv_dense()


def test_panels_take_up_to_max_rows_and_replace_the_dense_weight(monkeypatch):
    """On an AVX-512 host: 1 to cpu_gemm.MAX_ROWS rows go through the panels (as F.linear, ~1e-6),
    more through oneDNN; no dense weight is kept for MKL's GEMV, so drop_dense drops them all."""
    from splitserve.kernels.cpu import gemm as cpu_gemm

    if not cpu_gemm.load():
        pytest.skip("no AVX-512 here (or the op is off): the projections keep oneDNN and MKL")
    monkeypatch.setenv("SPLITSERVE_CPU_GEMV", "1")
    gen = torch.Generator().manual_seed(3)
    model = torch.nn.Sequential(Linear(64, 40), Linear(40, 16, bias=False))
    weight, bias = model[0].weight.detach().clone(), model[0].bias.detach().clone()
    assert cpu_linear.prepare_model(model, "fp32") == {"onednn + panels": 2}
    mm = model[0].cpu_matmul
    assert mm.panels is not None and mm.dense is None
    calls = []
    monkeypatch.setattr(
        cpu_linear, "packed_linear", lambda *a: calls.append(a) or F.linear(a[0], weight, bias)
    )
    for rows in (1, 2, 13, cpu_gemm.MAX_ROWS):
        x = torch.randn(rows, 64, generator=gen)
        torch.testing.assert_close(model[0](x), F.linear(x, weight, bias), rtol=1e-5, atol=1e-5)
    assert not calls
    model[0](torch.randn(cpu_gemm.MAX_ROWS + 1, 64, generator=gen))
    assert len(calls) == 1
    assert cpu_linear.drop_dense(model) == (64 * 40 + 40 * 16) * 4


def test_no_panels_where_a_second_copy_would_not_fit(monkeypatch, caplog):
    """The panels are built only within PANELS_MEMORY_SHARE of the available memory: past it the
    projections keep oneDNN (and MKL's GEMV where asked) and the log says why."""
    started = []
    monkeypatch.setattr(cpu_linear.cpu_gemm, "start", lambda: started.append(1) or True)
    monkeypatch.setenv("SPLITSERVE_CPU_GEMV", "0")
    model = torch.nn.Sequential(Linear(64, 32), Linear(32, 16, bias=False))
    room = int((64 * 32 + 32 * 16) * 4 / cpu_linear.PANELS_MEMORY_SHARE)  # just enough for the panels
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: room)
    assert cpu_linear.prepare_model(model, "fp32") == {"onednn + panels": 2}
    assert started == [1]
    monkeypatch.setattr(cpu_linear, "available_memory", lambda: room - 4)
    with caplog.at_level("WARNING", logger=cpu_linear.__name__):
        assert cpu_linear.prepare_model(model, "fp32") == {"onednn": 2}
    assert started == [1] and model[0].cpu_matmul.panels is None
    assert "no decode panels" in caplog.text
