"""How often our bf16 engine's greedy token is HF transformers' bf16 top-1, at small shape, on many steps.

The GPU test (tests/gpu/test_cuda_engine.py) checks this on 384 steps, where one step is 0.26%; this
script measures it on thousands, for a tiny random-weight Qwen3 (the test's config, HF's default
initializer_range 0.02 unless `--init` says otherwise) and prints, on the same token sequences:

* ours vs HF bf16: HF's bf16 forward, teacher-forced on our greedy tokens, picks our token (strict:
  its argmax; tied: our token's logit equals its max, bf16 logits tie often);
* ours vs HF fp32, and HF bf16 vs HF fp32 (how far bf16 itself moves the top-1 on these sequences);
* HF against itself: HF's bf16 greedy `generate`, teacher-forced through its own bf16 forward (the
  same products in other shapes: the agreement the reference itself reaches);

for our engine decoding all prompts together ("batch": cuBLAS GEMMs, graphs of 8 or more) and one
prompt at a time ("one": the batch-1 GEMVs, fused unless `SPLITSERVE_GEMV_FUSE=0`; "one, cuBLAS":
torch's matmuls, `SPLITSERVE_GEMV=0`).

    python bench/bf16_agreement.py                      # 32 prompts x 96 new tokens, init 0.02
    python bench/bf16_agreement.py --init 0.02 0.05 --prompts 64
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve import LLM, SamplingParams  # noqa: E402
from splitserve.model.agreement import hf_self_agreement, top1_counts  # noqa: E402

DEVICE = "cuda"


def tiny_qwen3(path: Path, init: float, seed: int = 0) -> torch.nn.Module:
    """The GPU test's tiny Qwen3 (`SMALL_QWEN3`: 3 layers, hidden 128, vocab 1,000), saved to `path`;
    -> HF's model."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    from splitserve.model.random_weights import SMALL_QWEN3

    torch.manual_seed(seed)
    model = Qwen3ForCausalLM(Qwen3Config(**SMALL_QWEN3, initializer_range=init)).eval()
    model.save_pretrained(path)
    return model


def ours(path: str, prompts: list[list[int]], new: int, together: bool, gemv: bool = True) -> list[list[int]]:
    from splitserve.kernels import gemv as gemv_mod

    gemv_mod.ENABLED, was = gemv, gemv_mod.ENABLED
    try:
        llm = LLM(model=path, device=DEVICE, dtype="bfloat16", kv_cache_bytes=256 * 2**20, progress=False)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True)
        batches = [prompts] if together else [[p] for p in prompts]
        out = []
        for batch in batches:
            outs = llm.generate([{"prompt_token_ids": p} for p in batch], params, use_tqdm=False)
            out += [o.outputs[0].token_ids for o in outs]
        del llm
        return out
    finally:
        gemv_mod.ENABLED = was


@torch.inference_mode()
def teacher_forced(
    hf16: torch.nn.Module, hf32: torch.nn.Module, prompts: list[list[int]], outs: list[list[int]]
) -> dict[str, int]:
    n = dict.fromkeys(("strict", "tied", "vs_fp32", "hf_bf16_vs_fp32", "steps"), 0)
    for prompt, out in zip(prompts, outs, strict=True):
        ids = torch.tensor([prompt + out], device=DEVICE)
        rows = slice(len(prompt) - 1, -1)
        l16 = hf16(ids).logits[0, rows]
        top32 = hf32(ids).logits[0, rows].argmax(-1)
        mine = torch.tensor(out, device=DEVICE)
        strict, tied = top1_counts(l16, mine)
        n["strict"] += strict
        n["tied"] += tied
        n["vs_fp32"] += int((top32 == mine).sum())
        n["hf_bf16_vs_fp32"] += int((l16.argmax(-1) == top32).sum())
        n["steps"] += len(out)
    return n


def hf_self(hf16: torch.nn.Module, prompts: list[list[int]], new: int) -> dict[str, int]:
    strict, tied, steps = hf_self_agreement(hf16, prompts, new, DEVICE)
    return {"strict": strict, "tied": tied, "steps": steps}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--init", type=float, nargs="+", default=[0.02], help="HF initializer_range(s)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0, help="weights' seed (prompts use seed + 1)")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script")
    ap.add_argument("--json", help="write the counts here")
    args = ap.parse_args()
    global DEVICE
    DEVICE = args.device
    g = torch.Generator().manual_seed(args.seed + 1)
    lengths = torch.randint(4, 400, (args.prompts,), generator=g).tolist()
    results = []
    for init in args.init:
        with tempfile.TemporaryDirectory() as tmp:
            model = tiny_qwen3(Path(tmp), init, args.seed)
            prompts = [torch.randint(0, 1000, (n,), generator=g).tolist() for n in lengths]
            runs = {"batch": ours(tmp, prompts, args.new_tokens, True)}
            runs["one"] = ours(tmp, prompts, args.new_tokens, False)
            runs["one, cuBLAS"] = ours(tmp, prompts, args.new_tokens, False, gemv=False)
        hf32 = model.to(DEVICE, torch.float32)
        import copy

        hf16 = copy.deepcopy(hf32).to(torch.bfloat16)
        row: dict = {"init": init}
        for name, outs in runs.items():
            row[name] = teacher_forced(hf16, hf32, prompts, outs)
        row["hf_self"] = hf_self(hf16, prompts, args.new_tokens)
        results.append(row)

        def pct(c: dict[str, int], k: str) -> str:
            return f"{c[k]}/{c['steps']} = {c[k] / c['steps']:.2%}"

        print(f"init {init}:")
        for name in runs:
            c = row[name]
            print(f"  ours ({name}) vs HF bf16: strict {pct(c, 'strict')}, tied {pct(c, 'tied')}; "
                  f"vs HF fp32 {pct(c, 'vs_fp32')}; HF bf16 vs fp32 {pct(c, 'hf_bf16_vs_fp32')}")  # fmt: skip
        c = row["hf_self"]
        print(f"  HF bf16 generate vs its own forward: strict {pct(c, 'strict')}, tied {pct(c, 'tied')}")
        del hf16, hf32, model
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
