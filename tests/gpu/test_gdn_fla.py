"""The varlen fla prefill path of the Gated DeltaNet layers on CUDA against the torch rule: one layer on
a mixed decode + prefill batch (fp32, outputs and states), and greedy tokens of a small Qwen3.5 in fp32
token for token, whole prompts and prompts split mid-chunk; bf16 top-1 agreement with the torch rule.

Skipped without a GPU or fla-core. The fp32 comparisons need Triton's fp32 dots in IEEE fp32 (fla's are
tf32 by default: 20% of the layer's outputs then differ from the torch rule by up to 6e-3, where the
torch rule is within 4e-6 of an fp64 computation; bench/gdn_fla_precision.py): tests/gpu/conftest.py sets
TRITON_F32_DEFAULT=ieee before any kernel is compiled.
"""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.model import gdn_prefill
from splitserve.model.decoder import ForwardContext
from splitserve.model.gdn_case import gdn_layer_case
from splitserve.model.random_weights import SMALL_QWEN3_5

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available() or gdn_prefill.fla_rule() is None, reason="needs CUDA and fla-core"
)


def test_layer_fla_matches_torch():
    case = gdn_layer_case("cuda")
    layer, states, meta, x = case.layer, case.states, case.meta, case.x
    ref_states = {k: v.clone() for k, v in states.items()}
    with torch.no_grad():
        ref = layer(x, ForwardContext(attn=None, meta=meta, kv_cache=torch.empty(0), states=ref_states))
        layer.varlen = True
        lp = gdn_prefill.build_linear_prefill(meta, x.device)
        out = layer(x, ForwardContext(None, meta, torch.empty(0), states, linear_prefill=lp))
    torch.testing.assert_close(out, ref, rtol=2e-4, atol=2e-4)
    for name in states:
        torch.testing.assert_close(states[name], ref_states[name], rtol=2e-4, atol=2e-4)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("small_qwen3_5")
    Qwen3_5ForCausalLM(Qwen3_5TextConfig(**SMALL_QWEN3_5)).save_pretrained(path)
    return str(path)


def _prompts() -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, 512, (n,), generator=g).tolist() for n in (7, 33, 90, 150, 61, 300)]


def _run(path: str, dtype: str, backend: str, **knobs) -> list[list[int]]:
    llm = LLM(
        model=path, device="cuda", dtype=dtype, kv_cache_bytes=64 * 2**20, progress=False,
        linear_attention_backend=backend, **knobs,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    outs = llm.generate([{"prompt_token_ids": p} for p in _prompts()], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("budget", [2048, 45])
def test_fp32_greedy_fla_equals_torch(checkpoint, budget):
    ref = _run(checkpoint, "float32", "torch", max_num_batched_tokens=budget)
    assert _run(checkpoint, "float32", "fla", max_num_batched_tokens=budget) == ref


def test_bf16_fla_agrees_with_torch(checkpoint):
    ref = _run(checkpoint, "bfloat16", "torch")
    got = _run(checkpoint, "bfloat16", "fla")
    first = sum(a[0] == b[0] for a, b in zip(ref, got, strict=True))  # the prefill's own token
    assert first == len(ref), (ref, got)
