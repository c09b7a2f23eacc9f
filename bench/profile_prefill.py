"""Where a hybrid prefill step's time goes on a GPU: B prompts of L tokens on random Qwen3.5-9B weights
(`random:qwen3.5-9b`, no HF), timed after a warm-up at the same shape (median of `--repeats`), then
one more profiled with torch.profiler: the kernels that take the most, and the host's time.

    python bench/profile_prefill.py --batch 32 --prompt-len 512
    python bench/profile_prefill.py --batch 1 --prompt-len 4096 --linear-backend torch
    python bench/profile_prefill.py --batch 1 --prompt-len 64 1088 2048 --top 0   # step time by length

With several lengths each is timed in turn (warm-up, then `--repeats`) and only the first is profiled.
`--prefill-graphs both` times each length with the one-chunk prefill CUDA graphs (engine/prefill_graphs.py)
replayed and with them off (eager), alternated. `--prefix 1024 64` then times prefix-cache hits (a shared
1,024-token system prompt, each request its own 64-token tail, one at a time; from the third request
on) against misses (unique prompts of the same length), with the graphs on and off.
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

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.model.random_weights import random_model, random_source_config  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402


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


def graphs(engine: LLMEngine, saved: object, mode: str) -> None:
    """The prefill graphs replayed ("on") or not ("off") from the next step."""
    engine.runner.prefill_graphs = saved if mode == "on" else None


def profile_one(engine: LLMEngine, prompts: torch.Tensor, top: int) -> None:
    """One prefill under torch.profiler: GPU kernel time against the wall, the top kernels, host time."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        t = prefill_once(engine, prompts)
    events = prof.key_averages()
    gpu = sum(e.self_device_time_total for e in events) / 1e3
    print(f"GPU kernel time {gpu:.1f} ms in a {t * 1e3:.1f} ms prefill (under the profiler)")
    gaps(prof.events())
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=70))
    print(events.table(sort_by="self_cpu_time_total", row_limit=12, max_name_column_width=70))


def gaps(events: list, show: int = 12) -> None:
    """The GPU's idle time between its kernels (the union of their intervals against the span), and
    the largest gaps with the kernels on either side: where the host, not the GPU, set the pace."""
    from torch.autograd import DeviceType

    spans = sorted(
        (e.time_range.start, e.time_range.end, e.name)
        for e in events
        if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start
    )
    if not spans:
        return
    idle, holes, end, last = 0.0, [], spans[0][1], spans[0][2]
    for s, e, name in spans[1:]:
        if s > end:
            idle += s - end
            holes.append((s - end, last, name))
        if e > end:
            end, last = e, name
    span = (end - spans[0][0]) / 1e3
    print(f"GPU idle {idle / 1e3:.1f} ms of a {span:.1f} ms span, in {len(holes)} gaps; the largest:")
    for us, before, after in sorted(holes, reverse=True)[:show]:
        print(f"  {us:8.0f} us  after {before[:60]}  before {after[:60]}")


def sync_sites(engine: LLMEngine, prompts: torch.Tensor) -> None:
    """Every place one prefill makes the host wait for the GPU (torch's sync debug mode), by count."""
    import collections
    import traceback
    import warnings

    sites: collections.Counter[str] = collections.Counter()

    def record(*_a: object, **_k: object) -> None:
        frames = [
            f
            for f in traceback.extract_stack()
            if "torch/" not in f.filename and "warnings" not in f.filename
        ]
        sites[" < ".join(f"{Path(f.filename).name}:{f.lineno}" for f in reversed(frames[-6:]))] += 1

    saved, warnings.showwarning = warnings.showwarning, record
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            prefill_once(engine, prompts)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    warnings.showwarning = saved
    print(f"host syncs in one prefill: {sum(sites.values())}")
    for site, n in sites.most_common(25):
        print(f"  {n:4d}  {site}")


def prefix_hits(engine: LLMEngine, saved: object, prefix: int, tail: int, reps: int, top: int = 0) -> None:
    """Hit (3rd request on, sharing a `prefix`-token system prompt) vs miss TTFT, graphs on and off;
    with `top`, one more hit (graphs on) is profiled."""
    gen = torch.Generator().manual_seed(5)
    for mode in ("on", "off"):
        graphs(engine, saved, mode)
        system = torch.randint(0, 248320, (1, prefix), generator=gen)
        shared = [
            torch.cat([system, torch.randint(0, 248320, (1, tail), generator=gen)], 1) for _ in range(reps)
        ]
        hit = [prefill_once(engine, p) for p in shared][2:]
        miss = [prefill_once(engine, torch.randint(0, 248320, (1, prefix + tail), generator=gen))
                for _ in range(reps)]  # fmt: skip
        if mode == "on" and top:
            one = torch.cat([system, torch.randint(0, 248320, (1, tail), generator=gen)], 1)
            profile_one(engine, one, top)
        h, m = statistics.median(hit), statistics.median(miss)
        print(f"prefix {prefix} + {tail}, prefill graphs {mode}: hit {h * 1e3:.1f} ms (runs "
              f"{', '.join(f'{x * 1e3:.1f}' for x in hit)}), miss {m * 1e3:.1f} ms (runs "
              f"{', '.join(f'{x * 1e3:.1f}' for x in miss)}): {h / m:.2f}x", flush=True)  # fmt: skip


def cprofile_steps(engine: LLMEngine, saved: object, batch: int, lengths: list[int]) -> None:
    """Where the host's time goes in one eager (no prefill graph) step per length: cProfile, by own time."""
    import cProfile
    import pstats

    graphs(engine, saved, "off")
    gen = torch.Generator().manual_seed(9)
    for length in lengths:
        prompts = torch.randint(0, 248320, (batch, length), generator=gen)
        with cProfile.Profile() as prof:
            t = prefill_once(engine, prompts)
        print(f"cProfile of one eager {batch} x {length} step ({t * 1e3:.1f} ms with the profiler):")
        pstats.Stats(prof).sort_stats("tottime").print_stats(16)


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
    ap.add_argument("--prefill-graphs", choices=("on", "off", "both"), default="on")
    ap.add_argument("--cprofile", action="store_true", help="cProfile one eager step per length (host time)")
    ap.add_argument("--prefix", type=int, nargs=2, default=None, metavar=("PREFIX", "TAIL"))
    ap.add_argument("--sync-sites", action="store_true", help="list where one prefill waits on the GPU")
    args = ap.parse_args()
    dev = torch.device("cuda")
    max_len = max(args.prompt_len) + 16
    loaded = random_model(random_source_config("random:qwen3.5-9b"), dev, torch.bfloat16, max_len)
    config = EngineConfig(model="random:qwen3.5-9b", max_num_seqs=max(args.batch, 2), max_model_len=max_len,
                          max_num_batched_tokens=max(args.max_batched_tokens, max_len - 16),
                          kv_cache_bytes=args.batch * max_len * 40 * 2**10 + 2**28,
                          linear_attention_backend=args.linear_backend,
                          enable_prefix_caching=args.prefix is not None,
                          progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=False, loaded=loaded)
    saved = engine.runner.prefill_graphs
    print(f"prefill graphs captured: {saved.sizes if saved else None}; start-up graph capture "
          f"{engine.graph_capture_s:.1f} s", flush=True)  # fmt: skip
    if args.prefix:
        prefix_hits(engine, saved, *args.prefix, max(args.repeats, 3) + 2, args.top)
    gen = torch.Generator().manual_seed(0)
    graphs(engine, saved, "off" if args.prefill_graphs == "off" else "on")
    by_graphs = args.prefill_graphs == "both"  # else by --fla-direct
    modes = ["on", "off"] if by_graphs or args.fla_direct == "both" else [args.fla_direct]
    what = "prefill graphs" if by_graphs else "fla direct"

    def switch(m: str) -> None:
        if by_graphs:
            graphs(engine, saved, m)
        else:
            direct(m)

    for length in args.prompt_len:
        # fresh prompts for every run: with --prefix, caching is on and a repeated prompt would hit
        batches = [torch.randint(0, 248320, (args.batch, length), generator=gen) for _ in range(4)]
        times: dict[str, list[float]] = {m: [] for m in modes}
        for m in modes:
            switch(m)
            prefill_once(engine, torch.randint(0, 248320, (args.batch, length), generator=gen))  # warm-up
        for _ in range(args.repeats):  # alternated
            for m in modes:
                switch(m)
                times[m].append(
                    prefill_once(engine, torch.randint(0, 248320, (args.batch, length), generator=gen))
                )
        n = args.batch * length
        for m in modes:
            t = statistics.median(times[m])
            print(
                f"prefill {args.batch} x {length} ({args.linear_backend}, {what} {m}): {t * 1e3:.1f} ms, "
                f"{n / t:.0f} tok/s (runs: {', '.join(f'{x * 1e3:.1f}' for x in times[m])} ms)",
                flush=True,
            )
        if length == args.prompt_len[0]:
            first, t_first = batches, statistics.median(times[modes[0]])
    if args.cprofile:
        cprofile_steps(engine, saved, args.batch, args.prompt_len)
    switch(modes[0])
    if args.sync_sites:
        sync_sites(engine, first[2])
    print(f"median prefill {t_first * 1e3:.1f} ms; one more under the profiler:")
    profile_one(engine, first[1], args.top)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
