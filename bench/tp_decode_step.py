"""Tensor parallelism on the CPU: a decode step at tensor_parallel_size 2 against 1, in the same run.

Random weights at a named shape (default: random:qwen3-mini, 8 layers of hidden 1024, so that the products
are not trivially small), fp32, greedy. Each engine decodes a batch of B requests whose
prompts are already prefilled; the script times the decode steps and prints, for each TP size: the
median step time, the ratio against TP=1 (the baseline), the bytes rank 0 all-reduced per step and
per layer (the collectives' payload: hidden x rows x 4 bytes, twice a layer, plus the embedding's),
and the logits' all-gather. Both runs use the same threads per rank (`--threads`, default 1), so at
TP=2 the step has twice the cores: on a shared 2-core host the figure shows what the collectives cost
(gloo over loopback TCP) against what halving each rank's products saves; there is no speed goal here.
Greedy tokens of both runs are compared (they must be equal). NOTE: at TP=1 a decode step of the CPU
takes the whole-layer C++ op (kernels/cpu/layer.py), which tensor parallelism turns off (its products
have no all-reduce between them): part of the difference is that op, not the collectives.

    python bench/tp_decode_step.py                     # batch 8, 32 decode steps
    python bench/tp_decode_step.py --model random:qwen3.5-tiny --batch 4
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.sampling.params import SamplingParams


def run(
    model: str, tp: int, batch: int, steps: int, prompt_len: int
) -> tuple[list[float], list[list[int]], int]:
    engine = LLMEngine(
        EngineConfig(model=model, tensor_parallel_size=tp, dtype="float32", device="cpu", max_model_len=1024,
                     kv_cache_bytes=256 << 20, max_num_seqs=batch, progress=False),
        tokenizer=False,
    )  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=steps + 1, ignore_eos=True)
    gen = torch.Generator().manual_seed(0)
    for i in range(batch):
        engine.add_request(torch.randint(3, 500, (prompt_len,), generator=gen).tolist(), params, f"r{i}")
    while (
        any(r.num_computed_tokens < r.num_prompt_tokens for r in engine.scheduler.running)
        or engine.scheduler.waiting
    ):
        engine.step()  # the prompts (and the first tokens)
    group = getattr(engine.runner, "group", None)
    before = group.bytes_reduced if group is not None else 0
    times, tokens = [], {}
    while engine.has_unfinished_requests():
        t0 = time.perf_counter()
        outs = engine.step()
        times.append(time.perf_counter() - t0)
        for o in outs:
            tokens[o.request_id] = o.outputs[0].token_ids
    reduced = (group.bytes_reduced - before) // max(1, len(times)) if group is not None else 0
    if tp > 1:
        engine.runner.close()
    return times, [tokens[f"r{i}"] for i in range(batch)], reduced


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:qwen3-mini")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--threads", type=int, default=1, help="torch threads per rank")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    results = {tp: run(args.model, tp, args.batch, args.steps, args.prompt_len) for tp in (1, 2)}
    base = statistics.median(results[1][0])
    print(
        f"model {args.model}, batch {args.batch}, {args.steps} decode steps, "
        f"{args.threads} thread(s) per rank"
    )
    for tp, (times, _, reduced) in results.items():
        med = statistics.median(times)
        print(f"TP={tp}: decode step median {med * 1e3:.2f} ms (TP=1 baseline {base * 1e3:.2f} ms, "
              f"ratio {med / base:.2f}x); rank 0 all-reduced {reduced / 1e3:.1f} kB a step")  # fmt: skip
    print("greedy tokens equal:", results[1][1] == results[2][1])


if __name__ == "__main__":
    main()
