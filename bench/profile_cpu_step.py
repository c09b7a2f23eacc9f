"""Where a CPU engine step's time goes: the endpoint's rate-inf load replayed in one process.

Builds the default model's engine (SmolLM2-135M, fp32, as a served worker builds it), adds `--prompts`
random prompts of `--prompt-len` at once (what `vllm bench serve --request-rate inf` sends) and steps
the engine, printing each step's wall time with its prefill and decode token counts and the time to
each group of first tokens (what the client's TTFT sees, without HTTP); then profiles `--steps` decode
steps at the full batch with torch.profiler (self CPU time by op).

    python bench/profile_cpu_step.py                          # 64 prompts of 256, 64 tokens each
    python bench/profile_cpu_step.py --prompts 8 --output-len 32 --steps 10
    SPLITSERVE_CPU_ATTN=0 python bench/profile_cpu_step.py    # decode attention: KV gathered + SDPA
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.model import cpu_attention  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--steps", type=int, default=10, help="decode steps profiled at the full batch")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--budget", type=int, default=2048, help="max_num_batched_tokens")
    args = ap.parse_args()

    config = EngineConfig(model=args.model, progress=False, kv_cache_bytes=1 << 30, max_model_len=4096,
                          max_num_seqs=max(args.prompts, 8), max_num_batched_tokens=args.budget)  # fmt: skip
    engine = LLMEngine(config, tokenizer=False)
    attn = engine.runner.attn
    if getattr(attn, "cpu_kernel", False):
        cpu_attention.load()  # waits for the build the engine started
    path = "paged op" if getattr(attn, "cpu_kernel", False) and cpu_attention.ready() else "gather + SDPA"
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads; decode attention: {path}")
    vocab = engine.model_config.vocab_size
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)
    for p in torch.randint(0, vocab, (4, 64), generator=gen).tolist():  # warm: oneDNN primitives
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=4, ignore_eos=True, detokenize=False))
    while engine.has_unfinished_requests():
        engine.step()

    prompts = torch.randint(0, vocab, (args.prompts, args.prompt_len), generator=gen).tolist()
    for p in prompts:
        engine.add_request(p, params)
    t0 = time.perf_counter()
    firsts: list[float] = []
    step = 0
    print("| step | prefill tokens | decode rows | ms | first tokens (s since start) |")
    print("|---|---|---|---|---|")
    while engine.has_unfinished_requests() and len(firsts) < args.prompts:
        before = {rid: len(r.output_token_ids) for rid, r in engine.requests.items()}
        done = sum(min(len(r.prompt_token_ids), r.num_computed_tokens) for r in engine.requests.values())
        running = [r for r in engine.requests.values() if r.num_computed_tokens >= len(r.prompt_token_ids)]
        t = time.perf_counter()
        if step == 1:  # a whole prefill step (with decode rows), oneDNN's primitives built by step 0
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prefill_prof:
                engine.step()
        else:
            engine.step()
        ms = (time.perf_counter() - t) * 1e3
        new = sum(1 for rid, r in engine.requests.items() if before.get(rid) == 0 and r.output_token_ids)
        now = time.perf_counter() - t0
        firsts += [now] * new
        prefill = sum(min(len(r.prompt_token_ids), r.num_computed_tokens) for r in engine.requests.values())
        print(f"| {step} | {prefill - done} | {len(running)} | {ms:.0f} | {new} at {now:.2f} |")
        step += 1
    print(f"mean time to first token over {len(firsts)}: {sum(firsts) / max(len(firsts), 1):.2f} s")
    if step > 1:
        print("\nstep 1 (prefill) under the profiler, by self CPU time:")
        print(prefill_prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    for _ in range(3):
        engine.step()
    n = len(engine.requests)
    from torch.profiler import ProfilerActivity, profile

    t = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(args.steps):
            engine.step()
    wall = (time.perf_counter() - t) / args.steps
    print(f"\ndecode at batch {n}: {wall * 1e3:.1f} ms/step under the profiler")
    print(
        prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top, max_name_column_width=50)
    )
    t = time.perf_counter()
    steps = 0
    while engine.has_unfinished_requests() and steps < args.steps:
        engine.step()
        steps += 1
    print(f"decode at batch {n}: {(time.perf_counter() - t) / max(steps, 1) * 1e3:.1f} ms/step unprofiled")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
