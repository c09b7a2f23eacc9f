"""The same engine code on CUDA: fp32 token-exact with the CPU path; bf16 close to HF on the GPU.

Skipped without a GPU (CI has none); run on a GPU machine with `python -m pytest tests/gpu -q`.
"""

from __future__ import annotations

import pytest
import torch

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tiny_checkpoint(tmp_path, arch: str):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    if arch == "qwen3":
        cfg = Qwen3Config(
            vocab_size=1000,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=3,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            initializer_range=0.15,
            max_position_embeddings=1024,
        )
        model = Qwen3ForCausalLM(cfg)
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        cfg = Qwen3_5TextConfig(
            vocab_size=512,
            hidden_size=128,
            intermediate_size=256,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            linear_num_key_heads=2,
            linear_num_value_heads=4,
            linear_key_head_dim=16,
            linear_value_head_dim=16,
            initializer_range=0.1,
            max_position_embeddings=1024,
        )
        model = Qwen3_5ForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    return model, str(tmp_path)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 33, 90, 150)]


def _run(path: str, device: str, dtype: str, prompts, **knobs):
    llm = LLM(model=path, device=device, dtype=dtype, kv_cache_bytes=64 * 2**20, progress=False, **knobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_cuda_fp32_equals_cpu_fp32(tmp_path, arch):
    model, path = _tiny_checkpoint(tmp_path, arch)
    prompts = _prompts(model.config.vocab_size)
    cpu = _run(path, "cpu", "float32", prompts)
    cuda = _run(path, "cuda", "float32", prompts, max_num_batched_tokens=64)
    # TF32 is off by default for matmuls in torch; fp32 on both sides must agree token for token
    assert cuda == cpu


def test_cuda_bf16_is_as_close_to_fp32_as_hf_bf16(tmp_path):
    """bf16 drifts from fp32 at near-ties; ours must drift no more than HF's own bf16 path does.

    Teacher-forced on our bf16 greedy continuations: the fp32 model's top-1 is the reference.
    """
    model, path = _tiny_checkpoint(tmp_path, "qwen3")
    prompts = _prompts(model.config.vocab_size)
    ours = _run(path, "cuda", "bfloat16", prompts)
    ref = model.to("cuda", torch.float32).eval()
    hf_bf16 = _tiny_checkpoint(tmp_path / "copy", "qwen3")[0].to("cuda", torch.bfloat16).eval()
    ours_ok = hf_ok = total = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, ours, strict=True):
            ids = torch.tensor([prompt + out], device="cuda")
            rows = slice(len(prompt) - 1, -1)
            want = ref(ids).logits[0, rows].argmax(-1)
            hf = hf_bf16(ids).logits[0, rows].argmax(-1)
            ours_ok += int((want == torch.tensor(out, device="cuda")).sum())
            hf_ok += int((want == hf).sum())
            total += len(out)
    print(f"top-1 agreement with fp32: splitserve bf16 {ours_ok}/{total}, HF bf16 {hf_ok}/{total}")
    assert ours_ok / total >= 0.9
    assert ours_ok >= hf_ok - max(2, total // 50)
