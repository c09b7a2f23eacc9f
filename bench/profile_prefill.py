"""Where a hybrid prefill step's time goes on a GPU: B prompts of L tokens on random Qwen3.5-9B weights
(`random:qwen3.5-9b`, no HF), timed after a warm-up at the same shape (median of `--repeats`), then
one more profiled with torch.profiler: the kernels that take the most, and the host's time.

    python bench/profile_prefill.py --batch 32 --prompt-len 512
    python bench/profile_prefill.py --batch 1 --prompt-len 4096 --linear-backend torch
    python bench/profile_prefill.py --batch 1 --prompt-len 64 1088 2048 --top 0   # step time by length

With several lengths each is timed in turn (warm-up, then `--repeats`) and only the first is profiled.
`--fla-direct both` times each length with fla's forward kernels called directly (model/gdn_prefill.py's
`fla_forward`, the default) and through its public autograd Function, alternated in one process.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.engine.config import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.engine.params import SamplingParams  # noqa: E402
from splitserve.model.random_weights import random_model, random_source_config  # noqa: E402


def prefill_once(engine: LLMEngine, prompts: torch.Tensor) -> float:
    """Seconds until every prompt has its first token (one token each)."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for p in prompts.tolist():
        engine.add_request(p, params)
    while engine.has_unfinished_requests():
        engine.step()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def direct(mode: str) -> None:
    """fla's kernels called directly ("on") or through its public call ("off"), from the next step."""
    from splitserve.model import gdn_prefill

    os.environ["SPLITSERVE_FLA_DIRECT"] = "1" if mode == "on" else "0"
    gdn_prefill.fla_forward.cache_clear()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, nargs="+", default=[512])
    ap.add_argument("--max-batched-tokens", type=int, default=16384)
    ap.add_argument("--linear-backend", default="auto")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--fla-direct", choices=("on", "off", "both"), default="on")
    args = ap.parse_args()
    dev = torch.device("cuda")
    max_len = max(args.prompt_len) + 16
    loaded = random_model(random_source_config("random:qwen3.5-9b"), dev, torch.bfloat16, max_len)
    config = EngineConfig(model="random:qwen3.5-9b", max_num_seqs=max(args.batch, 2), max_model_len=max_len,
                          max_num_batched_tokens=max(args.max_batched_tokens, max_len - 16),
                          kv_cache_bytes=args.batch * max_len * 40 * 2**10 + 2**28,
                          linear_attention_backend=args.linear_backend, enable_prefix_caching=False,
                          progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=False, loaded=loaded)
    gen = torch.Generator().manual_seed(0)
    modes = ["on", "off"] if args.fla_direct == "both" else [args.fla_direct]
    for length in args.prompt_len:
        batches = [torch.randint(0, 248320, (args.batch, length), generator=gen) for _ in range(4)]
        times: dict[str, list[float]] = {m: [] for m in modes}
        for m in modes:
            direct(m)
            prefill_once(engine, batches[0])  # warm-up at this shape
        for i in range(args.repeats):  # alternated
            for m in modes:
                direct(m)
                times[m].append(prefill_once(engine, batches[1 + i % 3]))
        n = args.batch * length
        for m in modes:
            t = statistics.median(times[m])
            print(
                f"prefill {args.batch} x {length} ({args.linear_backend}, fla direct {m}): {t * 1e3:.1f} ms, "
                f"{n / t:.0f} tok/s (runs: {', '.join(f'{x * 1e3:.1f}' for x in times[m])} ms)",
                flush=True,
            )
        if length == args.prompt_len[0]:
            first, t_first = batches, statistics.median(times[modes[0]])
    direct(modes[0])
    batches, t = first, t_first
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        prefill_once(engine, batches[1])
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    print(f"GPU kernel time {gpu:.1f} ms in a {t * 1e3:.1f} ms prefill")
    print(events.table(sort_by="self_device_time_total", row_limit=args.top, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=10, max_name_column_width=70))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
