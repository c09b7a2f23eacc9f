"""The decode layer op (kernels/cpu/layer.py): a decode-only step through it gives bitwise the hidden
states of the Python path over the same ops, on tiny random-weight Qwen2 (QKV bias), Qwen3 (QK-norm)
and Llama checkpoints, fp32 (panels) and int4; greedy output through it in fp32 equals HF's."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.kernels.cpu import layer as cpu_layer
from splitserve.kernels.cpu import linear as cpu_linear

CASES = [
    ("qwen2", "fp32"),
    ("qwen3", "fp32"),
    ("llama3", "fp32"),
    ("qwen2", "int4"),
    ("qwen3", "int4"),
    ("llama3", "int4"),
]


@pytest.fixture(scope="module", autouse=True)
def op() -> None:
    if not cpu_layer.load(force=True):
        pytest.skip("the CPU ops could not be built here (no AVX-512 or no C++ compiler)")


class Checked:
    """The model's forward, patched: each step through the op where it applies, then again through the
    Python path (the KV it stores is the same both times); the hidden states must be the same bits.
    Counts the decode-only steps that took the op and the op's calls."""

    def __init__(self, model, monkeypatch) -> None:  # noqa: ANN001
        self.steps = self.calls = 0
        forward, op = type(model).forward, cpu_layer.decode_layer

        def counted(*args, **kwargs):
            self.calls += 1
            return op(*args, **kwargs)

        def both(model, input_ids, positions, ctx):
            decoding = ctx.meta.sole_decode_group(len(input_ids)) is not None
            used = decoding and model._cpu_layer_args(ctx, len(input_ids)) is not None
            out = forward(model, input_ids, positions, ctx)
            model.cpu_layer = False
            reference = forward(model, input_ids, positions, ctx)
            model.cpu_layer = True
            self.steps += used
            assert torch.equal(out, reference)
            return out

        monkeypatch.setattr(cpu_layer, "decode_layer", counted)
        monkeypatch.setattr(type(model), "forward", both)


def _generate(llm: LLM, tiny) -> list[list[int]]:  # noqa: ANN001
    greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in tiny.prompts], greedy, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize(("arch", "weights"), CASES)
def test_decode_steps_through_the_op_are_bitwise_the_python_path(tiny_model_factory, arch: str, weights: str,
                                                                 monkeypatch) -> None:  # fmt: skip
    monkeypatch.setattr(cpu_linear, "INT4_BF16_ROWS", 1 << 20)  # int4: the int4 kernels at every batch
    tiny = tiny_model_factory(arch)
    llm = LLM(model=str(tiny.path), max_model_len=256, progress=False, kv_cache_bytes=4 * 2**20,
              cpu_weights=weights)  # fmt: skip
    model = llm.engine.runner.model
    assert model.cpu_fused and model.cpu_layer
    checked = Checked(model, monkeypatch)
    tokens = _generate(llm, tiny)
    if weights == "fp32":
        assert tokens == tiny.hf_greedy
    assert checked.steps > 0 and checked.calls == checked.steps * model.cfg.num_layers


def test_the_op_follows_a_model_prepared_again(tiny_model_factory, monkeypatch) -> None:
    """fp32, then the same model's projections prepared again as int4 (the benches' A/B in one process):
    the op's steps take the new weights, not the arguments kept from the first."""
    monkeypatch.setattr(cpu_linear, "DROP_DENSE", False)
    monkeypatch.setattr(cpu_linear, "INT4_BF16_ROWS", 1 << 20)
    tiny = tiny_model_factory("qwen3")
    llm = LLM(model=str(tiny.path), max_model_len=256, progress=False, kv_cache_bytes=4 * 2**20)
    model = llm.engine.runner.model
    checked = Checked(model, monkeypatch)
    assert _generate(llm, tiny) == tiny.hf_greedy
    fp32_steps = checked.steps
    cpu_linear.prepare_model(model, "int4")
    _generate(llm, tiny)
    assert fp32_steps > 0 and checked.steps > fp32_steps


def test_the_op_is_not_used_without_panels(tiny_model_factory, monkeypatch) -> None:
    """fp32 projections through oneDNN alone (no panels: a host without AVX-512, or too little memory
    for them) keep the Python path: `_cpu_layer_args` answers None."""
    monkeypatch.setattr(cpu_linear.cpu_gemm, "start", lambda: False)
    tiny = tiny_model_factory("llama3")
    llm = LLM(model=str(tiny.path), max_model_len=256, progress=False, kv_cache_bytes=4 * 2**20)
    calls = [0]
    monkeypatch.setattr(cpu_layer, "decode_layer", lambda *a, **k: calls.append(1))
    greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in tiny.prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tiny.hf_greedy and calls == [0]


def test_int4_batches_leave_the_op_for_bf16_products(tiny_model_factory, monkeypatch) -> None:
    """The int4 option from `INT4_BF16_ROWS` rows (kernels/cpu/linear.py; 2 here): decode steps of one
    row take the op over the int4 codes; batches of more take the Python path, whose products are the
    bf16 weights."""
    monkeypatch.setattr(cpu_linear, "INT4_BF16_ROWS", 2)
    tiny = tiny_model_factory("qwen3")
    llm = LLM(model=str(tiny.path), max_model_len=256, progress=False, kv_cache_bytes=4 * 2**20,
              cpu_weights="int4")  # fmt: skip
    model = llm.engine.runner.model
    checked = Checked(model, monkeypatch)
    greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    llm.generate([{"prompt_token_ids": tiny.prompts[0]}], greedy, use_tqdm=False)
    alone = checked.steps
    assert alone == tiny.max_new - 1 and checked.calls == alone * model.cfg.num_layers
    _generate(llm, tiny)  # all prompts at once: batches of several rows
    assert len(tiny.prompts) >= 2
    assert checked.steps == alone, (checked.steps, alone)  # every step decodes several rows
