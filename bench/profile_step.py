"""Where a decode step's time goes on a GPU: wall time per engine step against the GPU kernels' time.

Builds the engine on random weights (no HF), decodes B sequences of a prompt of `--prompt-len`, and
profiles `--steps` decode steps with torch.profiler: prints the step's wall time, the summed kernel
time, and the kernels that take the most.

    python bench/profile_step.py --batch 1
    python bench/profile_step.py --batch 128 --enforce-eager
    python bench/profile_step.py --batch 32 --shape qwen3.5-9b --phases
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/hybrid_gpu.py's shapes

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.model.random_weights import random_model, random_model_config  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402


def _time_phases(engine: LLMEngine, steps: int) -> dict[str, float]:
    """Wall time per phase of `engine.step()`, averaged (the sampler's includes the wait on the GPU)."""
    spent: dict[str, float] = {}
    targets = [(engine.scheduler, "schedule"), (engine.runner, "execute"), (engine, "_update")]
    targets.append((engine, "_resolve"))  # overlapped steps: reads the pending step (waits for the GPU)
    if engine.runner.graphs is not None:
        targets.append((engine.runner.graphs, "run"))
    for obj, name in targets:
        inner = getattr(obj, name)

        def timed(*a, _inner=inner, _name=name, **kw):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return _inner(*a, **kw)
            finally:
                spent[_name] = spent.get(_name, 0.0) + time.perf_counter() - t

        setattr(obj, name, timed)
    sampler = engine.sampler

    class Timed:  # the sampler, timed (its __call__ waits for the GPU; sample_tokens does not)
        def __call__(self, logits, reqs):  # noqa: ANN001, ANN204
            return _timed_call(spent, "sample (waits for the GPU)", sampler, logits, reqs)

        def sample_tokens(self, logits, reqs):  # noqa: ANN001, ANN201
            return _timed_call(spent, "sample on the GPU (overlapped)", sampler.sample_tokens, logits, reqs)

    engine.sampler = Timed()  # type: ignore[assignment]
    t0 = time.perf_counter()
    for _ in range(steps):
        engine.step()
    spent["step"] = time.perf_counter() - t0
    engine.sampler = sampler
    return {k: v / steps for k, v in spent.items()}


def _timed_call(spent: dict[str, float], name: str, fn, *args):  # noqa: ANN001, ANN002, ANN202
    t = time.perf_counter()
    try:
        return fn(*args)
    finally:
        spent[name] = spent.get(name, 0.0) + time.perf_counter() - t


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="qwen3-8b-random", help="a random_weights shape, or qwen3.5-9b")
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--top", type=int, default=15)
    ap.add_argument("--cprofile", action="store_true", help="the host side: Python functions by own time")
    ap.add_argument("--phases", action="store_true", help="host time per phase of a step (schedule, ...)")
    args = ap.parse_args()
    dev = torch.device("cuda")
    if args.shape == "qwen3.5-9b":  # the hybrid, at the shape of bench/hybrid_gpu.py
        from hybrid_gpu import SHAPES
        from transformers import Qwen3_5TextConfig

        hf = Qwen3_5TextConfig(**SHAPES["9b"], max_position_embeddings=4096).to_dict()
        hf_config = {**hf, "architectures": ["Qwen3_5ForCausalLM"]}
    else:
        hf_config = random_model_config(args.shape)
    loaded = random_model(hf_config, dev, torch.bfloat16, 4096)
    config = EngineConfig(model=args.shape, max_num_seqs=max(args.batch, 8), max_num_batched_tokens=8192,
                          max_model_len=4096, gpu_memory_utilization=0.8, enforce_eager=args.enforce_eager,
                          progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=False, loaded=loaded)
    gen = torch.Generator().manual_seed(0)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True, detokenize=False)
    prompts = torch.randint(0, loaded.config.vocab_size, (args.batch, args.prompt_len), generator=gen)
    for p in prompts.tolist():
        engine.add_request(p, params)
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    for _ in range(5):
        engine.step()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        engine.step()
    wall = (time.perf_counter() - t0) / args.steps
    if args.phases:
        spent = _time_phases(engine, args.steps)
        print("host ms/step by phase: " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in spent.items()))
    if args.cprofile:
        import cProfile
        import pstats

        prof_py = cProfile.Profile()
        prof_py.enable()
        for _ in range(args.steps):
            engine.step()
        prof_py.disable()
        pstats.Stats(prof_py).sort_stats("tottime").print_stats(args.top)
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(args.steps):
            engine.step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    gpu_total = sum(e.device_time_total for e in events if e.device_type.name == "CUDA") / args.steps
    print(f"batch {args.batch}: wall {wall * 1e3:.2f} ms/step ({args.batch / wall:.0f} tok/s); "
          f"GPU kernels {gpu_total / 1e3:.2f} ms/step")  # fmt: skip
    print(events.table(sort_by="device_time_total", row_limit=args.top, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=60))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
