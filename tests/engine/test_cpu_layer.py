"""The decode layer op (model/cpu_layer.py): a decode-only step through it gives bitwise the hidden
states of the Python path over the same ops, on tiny random-weight Qwen2 (QKV bias), Qwen3 (QK-norm)
and Llama checkpoints, and greedy output through it equals HF's."""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.model import cpu_layer

ARCHS = ["qwen2", "qwen3", "llama3"]


@pytest.fixture(scope="module", autouse=True)
def op() -> None:
    if not cpu_layer.load(force=True):
        pytest.skip("the CPU ops could not be built here (no AVX-512 or no C++ compiler)")


@pytest.mark.parametrize("arch", ARCHS)
def test_decode_steps_through_the_op_are_bitwise_the_python_path(tiny_model_factory, arch: str,
                                                                 monkeypatch) -> None:  # fmt: skip
    tiny = tiny_model_factory(arch)
    llm = LLM(model=str(tiny.path), max_model_len=256, progress=False, kv_cache_bytes=4 * 2**20)
    model = llm.engine.runner.model
    assert model.cpu_fused
    forward, ready = type(model).forward, cpu_layer.ready
    layer_calls, decode_steps = [0], [0]
    op = cpu_layer.decode_layer

    def counted(*args, **kwargs):
        layer_calls[0] += 1
        return op(*args, **kwargs)

    def both(self, input_ids, positions, ctx):
        """The step through the op where it applies, then again through the Python path (the KV it
        stores is the same both times): the hidden states must be the same bits."""
        monkeypatch.setattr(cpu_layer, "ready", ready)
        used = self._cpu_layer_args(ctx, len(input_ids)) is not None
        out = forward(self, input_ids, positions, ctx)
        monkeypatch.setattr(cpu_layer, "ready", lambda: False)
        reference = forward(self, input_ids, positions, ctx)
        monkeypatch.setattr(cpu_layer, "ready", ready)
        decode_steps[0] += used
        assert torch.equal(out, reference)
        return out

    monkeypatch.setattr(cpu_layer, "decode_layer", counted)
    monkeypatch.setattr(type(model), "forward", both)
    greedy = SamplingParams(temperature=0, max_tokens=tiny.max_new, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in tiny.prompts], greedy, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == tiny.hf_greedy
    assert decode_steps[0] > 0 and layer_calls[0] == decode_steps[0] * model.cfg.num_layers


def test_the_op_is_not_used_without_panels(tiny_model_factory, monkeypatch) -> None:
    """int4 projections (no panels) keep the Python path: `_cpu_layer_args` answers None."""
    tiny = tiny_model_factory("llama3")
    llm = LLM(model=str(tiny.path), max_model_len=256, progress=False, kv_cache_bytes=4 * 2**20,
              cpu_weights="int4")  # fmt: skip
    calls = [0]
    monkeypatch.setattr(cpu_layer, "decode_layer", lambda *a, **k: calls.append(1))
    greedy = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": tiny.prompts[0]}], greedy, use_tqdm=False)
    assert len(outs[0].outputs[0].token_ids) == 4 and calls == [0]
