"""bf16 top-1 agreement with HF transformers at the Qwen3.5-9B hybrid shape: random
weights (HF's own initializer, `bench/hybrid_gpu.py`'s models: ours loads HF's tensors), our engine's
bf16 greedy tokens (the fla varlen prefill and the fused decode kernels in CUDA graphs), teacher-forced
through HF's bf16 forward and its fp32 forward (HF's torch fallback for the Gated DeltaNet: fla hidden
from it). The goal: ours vs HF bf16 at least HF bf16 vs HF fp32 on the same sequences.

    python bench/bf16_agreement_hybrid.py --prompts 16 --new-tokens 48
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.bf16_agreement import teacher_forced  # noqa: E402
from bench.hybrid_gpu import build_models  # noqa: E402
from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", default="9b")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=48)
    ap.add_argument("--seed", type=int, default=1)
    args = ap.parse_args()
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(args.seed)
    lengths = torch.randint(8, 400, (args.prompts,), generator=g).tolist()
    max_len = max(lengths) + args.new_tokens + 16
    hf16, loaded = build_models(args.shape, dev, torch.bfloat16, max_len, hf_fla=False)
    vocab = loaded.config.vocab_size
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in lengths]
    config = EngineConfig(model=f"random:qwen3.5-{args.shape}", max_num_seqs=max(args.prompts, 2),
                          max_model_len=max_len, kv_cache_bytes=2 << 30, enable_prefix_caching=False,
                          progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=False, loaded=loaded)
    params = SamplingParams(temperature=0, max_tokens=args.new_tokens, ignore_eos=True, detokenize=False)
    for p in prompts:
        engine.add_request(p, params)
    done: dict[str, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    outs = [done[f"req-{i}"] for i in range(len(prompts))]
    del engine, loaded
    torch.cuda.empty_cache()
    hf32 = copy.deepcopy(hf16).float()
    c = teacher_forced(hf16, hf32, prompts, outs)

    def pct(k: str) -> str:
        return f"{c[k]}/{c['steps']} = {c[k] / c['steps']:.2%}"

    span = f"{min(lengths)}-{max(lengths)}"
    print(f"Qwen3.5 {args.shape} shape, random weights, {args.prompts} prompts of {span} tokens, "
          f"{args.new_tokens} new each (our bf16 engine, batched):")  # fmt: skip
    print(f"  ours vs HF bf16: strict {pct('strict')}, tied {pct('tied')}; ours vs HF fp32 {pct('vs_fp32')}")
    print(f"  HF bf16 vs HF fp32 on the same sequences: {pct('hf_bf16_vs_fp32')}")
    met = c["strict"] >= c["hf_bf16_vs_fp32"]
    print(f"  goal (ours vs HF bf16, strict, >= HF bf16 vs HF fp32): {'met' if met else 'NOT met'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
