"""Top-1 agreement of the CPU int4 option (`cpu_weights="int4"`, kernels/cpu/linear.py) with the fp32 path.

The fp32 path generates greedy continuations of chat prompts; both paths then run the whole sequences
(prompt + continuation) teacher-forced, and each position's argmax is compared with the fp32 path's
token (strict; and tied: the token's logit equals the top logit). The fp32 path against itself is the
reference row (the same products in another shape: one forward over the sequence against one token a
step). Also prints both paths' own greedy outputs: how many match the fp32 ones token for token, and
the mean position of the first difference. The int4 option is run twice: as served (products of
`cpu_linear.INT4_BF16_ROWS` rows or more through its bf16 weights) and with the int4 kernels at every
batch ("int4 kernels").

    python bench/cpu_quant.py                       # the embedded default (a Q4_1 GGUF)
    python bench/cpu_quant.py --new-tokens 128 --prompts 16
    python bench/cpu_quant.py --llama-cpp           # also llama.cpp on the same GGUF (llama-cpp-python)

`--llama-cpp` adds a row for llama.cpp itself (the `llama_cpp` package, built for this host) running
the same GGUF file as it is, teacher-forced over the same sequences: the bar for the int4 option.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.model import cpu_linear  # noqa: E402
from splitserve.model.agreement import top1_counts  # noqa: E402
from splitserve.model.attention import AttentionMetadata, PrefillChunk  # noqa: E402
from splitserve.model.decoder import ForwardContext  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402

QUESTIONS = [
    "What is the capital of France?", "Name three primary colors.", "Write a haiku about the sea.",
    "Explain photosynthesis in two sentences.", "What is 17 times 23?", "Give me a recipe for pancakes.",
    "Why is the sky blue?", "List the planets of the solar system.", "What does a compiler do?",
    "Translate 'good morning' into Spanish.", "Summarize the plot of Romeo and Juliet.",
    "How do vaccines work?", "What is a prime number?", "Describe a cat to someone who has never seen one.",
    "What causes the seasons on Earth?", "Suggest a name for a bakery.",
]  # fmt: skip


def generate(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> tuple[list[list[int]], float]:
    """Greedy continuations, all prompts at once; -> (tokens, wall seconds)."""
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    ids = [engine.add_request(p, params) for p in prompts]
    done: dict[str, list[int]] = {}
    t = time.perf_counter()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.outputs[0].token_ids
    return [done[i] for i in ids], time.perf_counter() - t


@torch.inference_mode()
def teacher_forced(engine: LLMEngine, ids: list[int]) -> torch.Tensor:
    """Logits [T, V] at every position of `ids`, in one prefill over KV blocks 0.. (the engine idle).
    NOTE: overwrites those blocks; call it after the last generation, as main does."""
    assert not engine.has_unfinished_requests()
    t, bs = len(ids), engine.block_size
    chunk = PrefillChunk(0, t, t, torch.arange(-(-t // bs)))
    meta = AttentionMetadata(torch.arange(t), 0, (), (chunk,))
    model = engine.loaded.model
    ctx = ForwardContext(engine.runner.attn, meta, engine.kv_cache, engine.runner.states)
    return model.compute_logits(model(torch.tensor(ids), torch.arange(t), ctx))


def agreement(engine: LLMEngine, prompts: list[list[int]], outs: list[list[int]]) -> tuple[int, int, int]:
    strict = tied = total = 0
    for p, o in zip(prompts, outs, strict=True):
        logits = teacher_forced(engine, p + o)[len(p) - 1 : -1]
        s, t = top1_counts(logits, torch.tensor(o))
        strict, tied, total = strict + s, tied + t, total + len(o)
    return strict, tied, total


def llama_cpp_agreement(path: str, prompts: list[list[int]], outs: list[list[int]]) -> tuple[int, int, int]:
    """`agreement`, with llama.cpp's logits over each sequence (the GGUF's own quantized kernels)."""
    import numpy as np
    from llama_cpp import Llama

    llm = Llama(model_path=path, n_ctx=1024, n_batch=1024, logits_all=True, n_threads=torch.get_num_threads(),
                verbose=False)  # fmt: skip
    strict = tied = total = 0
    for p, o in zip(prompts, outs, strict=True):
        ids = p + o
        llm.reset()
        llm.eval(ids)
        logits = torch.from_numpy(np.array(llm.scores[: len(ids)], dtype=np.float32))[len(p) - 1 : -1]
        s, t = top1_counts(logits, torch.tensor(o))
        strict, tied, total = strict + s, tied + t, total + len(o)
    return strict, tied, total


def first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y), len(a))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF (Q4_1)")
    ap.add_argument("--prompts", type=int, default=len(QUESTIONS))
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--llama-cpp", action="store_true", help="add llama.cpp's row (needs llama-cpp-python)")
    args = ap.parse_args()
    cpu_linear.DROP_DENSE = False  # each path is prepared from the dense weights
    engine = LLMEngine(EngineConfig(model=args.model, progress=False, kv_cache_bytes=1 << 30))
    assert engine.tokenizer is not None
    prompts = [
        engine.tokenizer.apply_chat_template([{"role": "user", "content": q}])
        for q in (QUESTIONS * 4)[: args.prompts]
    ]
    model = engine.loaded.model
    runs = {}
    served_rows = cpu_linear.INT4_BF16_ROWS
    paths = {"fp32": ("fp32", served_rows), "int4": ("int4", served_rows), "int4 kernels": ("int4", 1 << 30)}
    for name, (kind, rows) in paths.items():
        cpu_linear.INT4_BF16_ROWS = rows
        counts = cpu_linear.prepare_model(model, kind)
        runs[name] = generate(engine, prompts, args.new_tokens)
        print(f"{name}: {counts}; {len(prompts)} prompts x {args.new_tokens} tokens greedy in "
              f"{runs[name][1]:.1f} s", flush=True)  # fmt: skip
    mats = [getattr(m, "cpu_matmul", None) for m in model.modules()]
    errs = [m.err for m in mats if isinstance(m, cpu_linear.Int4Matmul)]
    print(f"int4 codes: largest |w - dequantized| over {len(errs)} weights: {max(errs):.3g} "
          "(0 up to rounding: the GGUF's own Q4_1 codes)")  # fmt: skip
    ref = runs["fp32"][0]
    n = sum(map(len, ref))
    print(f"\nteacher-forced top-1 agreement with the fp32 path's greedy tokens ({n} positions):")
    print("| path | strict | with ties |")
    print("|---|---|---|")
    for name, (kind, rows) in paths.items():
        cpu_linear.INT4_BF16_ROWS = rows
        cpu_linear.prepare_model(model, kind)
        s, t, n = agreement(engine, prompts, ref)
        print(f"| {name} | {s / n:.2%} ({s}/{n}) | {t / n:.2%} |")
    if args.llama_cpp:
        from splitserve.model.checkpoint import tokenizer_path

        s, t, n = llama_cpp_agreement(str(tokenizer_path(args.model)), prompts, ref)
        print(f"| llama.cpp, the GGUF as it is | {s / n:.2%} ({s}/{n}) | {t / n:.2%} |")
    print()
    for name in ("int4", "int4 kernels"):
        own = runs[name][0]
        same = sum(a == b for a, b in zip(own, ref, strict=True))
        diverge = sum(first_difference(a, b) for a, b in zip(own, ref, strict=True)) / len(ref)
        print(f"{name} greedy vs fp32 greedy: {same}/{len(ref)} sequences identical; first difference at "
              f"token {diverge:.1f} on average (of {args.new_tokens})")  # fmt: skip
    a, b = runs["int4"][0], runs["int4 kernels"][0]
    same = sum(x == y for x, y in zip(a, b, strict=True))
    print(f"int4 greedy vs int4 kernels greedy: {same}/{len(a)} sequences identical (its two products)")
    cpu_linear.INT4_BF16_ROWS = served_rows
    cpu_linear.prepare_model(model, "fp32")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
