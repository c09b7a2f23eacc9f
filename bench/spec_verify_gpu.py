"""Speculative decoding on a GPU at Qwen3.5-9B shape (random bf16 weights, its MTP head included).

Two parts, each against its baseline measured in the same run:

  * step cost: B requests with `--prompt-len`-token prompts prefilled, then the model step alone
    (`ModelRunner.execute`), median of `--iters`: a plain decode step (one token a request; CUDA
    graphs as the engine replays them, and eager) against a verify step of k + 1 tokens a request
    (the drafts' rows), for each k and batch: replaying the hybrid verify graphs
    (engine/verify_graphs.py, captured here for these shapes where the batch is at most
    verify_graphs.MAX_WIDTH) and eagerly.
  * tokens/s: `--decode-tokens` greedy tokens a request at batch B, plain decoding (graphs on, as
    served) against `method: mtp` with k drafts, the acceptance forced to `--acceptance` per draft
    (random weights accept nothing: each draft is taken while a seeded coin says so, and the token
    after the last taken one is the target's own), the MTP head's drafting and the hybrid state's
    rollback included. The MTP head's runs replay its CUDA graphs (engine/spec/mtp_graphs.py);
    `--head-ab` adds each row with them off (the head run eagerly).
  * `--backoff` (instead of the two parts above): `--backoff-batch` requests (32) with the default
    `disable_by_batch_size` (8), so drafting is backed off and, past the head's grace
    (spec/verify.py), the MTP head stops too: `method: mtp` against plain decoding, alternating:
    tokens/s of each and the ratio, over the whole decode and past the grace; beside them, the head's
    runs (eager forwards and graph replays) and the requests that lost its context. `--backoff-ab`
    adds mtp with the head never stopping (every step caught up). Runs on the CPU too, with the
    tiny Qwen3.5 by default (`--device cpu`).

Without CUDA it prints a line and exits 0, but for `--backoff`.

    python bench/spec_verify_gpu.py                          # ~3 min on an H100
    python bench/spec_verify_gpu.py --ks 1,2,3 --batches 1,32 --acceptance 0.6
    python bench/spec_verify_gpu.py --head-ab    # mtp rows with the MTP head's graphs on, then off
    python bench/spec_verify_gpu.py --backoff --backoff-ab --decode-tokens 256         # on an H100
    python bench/spec_verify_gpu.py --backoff --backoff-ab --device cpu --prompt-len 64 \
        --decode-tokens 128
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections import Counter
from collections.abc import Sequence
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.engine.scheduler import ScheduledChunk  # noqa: E402
from splitserve.engine.spec import verify  # noqa: E402
from splitserve.engine.verify_graphs import MAX_WIDTH  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402

MODEL = "random:qwen3.5-9b"
CPU_MODEL = "random:qwen3.5-tiny"


def config(args: argparse.Namespace, spec: dict | None) -> EngineConfig:
    max_len = args.prompt_len + args.decode_tokens + 16
    batch = max(int(b) for b in args.batches.split(","))
    return EngineConfig(
        model=MODEL, device="cuda", dtype="bfloat16", max_model_len=max_len, max_num_seqs=batch,
        max_num_batched_tokens=max(batch * args.prompt_len, 2048), enable_prefix_caching=False,
        kv_cache_bytes=2 * batch * max_len * 64 * 2**10 + 2**28, speculative_config=spec, progress=False,
    )  # fmt: skip


def prompts(n: int, length: int, seed: int, vocab: int = 200_000) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(10, min(vocab, 200_000), (n, length), generator=g).tolist()


def sync(device: str) -> None:
    if device == "cuda":
        torch.cuda.synchronize()


def timed(fn, iters: int) -> float:  # noqa: ANN001
    """Median seconds of `fn()` over `iters` runs, after two warm-ups."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def step_costs(engine: LLMEngine, batch: int, ks: Sequence[int], args: argparse.Namespace) -> None:
    """Plain decode step against verify steps of k + 1 tokens, for `batch` requests after prefill."""
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    ids = [engine.add_request(p, params) for p in prompts(batch, args.prompt_len, seed=batch)]
    while any(not engine.requests[r].output_token_ids for r in ids):
        engine.step()
    reqs = [engine.requests[r] for r in ids]
    runner, blocks = engine.runner, engine.scheduler.block_manager
    for r in reqs:  # the slot of the next token, as the scheduler allocates before a decode step
        assert blocks.allocate(r, 1), "the KV cache is too small for a decode step"
    plain = [ScheduledChunk(r, r.num_computed_tokens, 1) for r in reqs]
    graphs, verify_graphs = runner.graphs, runner.verify_graphs
    t_graph = timed(lambda: runner.execute(plain), args.iters) if graphs is not None else float("nan")
    runner.graphs = None
    t_eager = timed(lambda: runner.execute(plain), args.iters)
    runner.graphs = graphs
    for r in reqs:
        blocks.trim(r)
    for k in ks:
        for r in reqs:
            assert blocks.allocate(r, 1 + k), "the KV cache is too small for the verify rows"
        chunks = [ScheduledChunk(r, r.num_computed_tokens, 1 + k, (7,) * k) for r in reqs]
        graphed = verify_graphs is not None and verify_graphs.accepts(chunks)
        t_vgraph = timed(lambda c=chunks: runner.execute(c), args.iters) if graphed else float("nan")
        runner.verify_graphs = None
        t_verify = timed(lambda c=chunks: runner.execute(c), args.iters)
        runner.verify_graphs = verify_graphs
        for r in reqs:
            blocks.trim(r)
        base = t_graph if graphs is not None else t_eager
        best = t_vgraph if graphed else t_verify
        print(f"batch {batch:3d}  k={k}: verify step {t_vgraph * 1e3:7.2f} ms (graphs) / "
              f"{t_verify * 1e3:7.2f} ms (eager), eager/graphs {t_verify / t_vgraph:5.2f}x   plain step "
              f"{base * 1e3:6.2f} ms (graphs) / {t_eager * 1e3:6.2f} ms (eager)   "
              f"verify/plain {best / base:5.2f}x (break-even accepted length)")  # fmt: skip
    for r in ids:
        engine.abort(r)
    while engine.has_unfinished_requests():
        engine.step()


def capture_verify_graphs(engine: LLMEngine, ks: Sequence[int], batches: Sequence[int]) -> None:
    """The hybrid verify graphs of k + 1 positions for each batch the verify graphs take, on the plain
    engine's runner (an engine with speculation captures those of its own k at start)."""
    widths = [b for b in batches if b <= MAX_WIDTH]
    scratch = engine.states.scratch
    if engine.runner.graphs is None or scratch is None or not widths:
        return
    shapes = [(w, k + 1) for w in widths for k in ks]
    seconds = engine.runner.enable_verify_graphs(
        shapes, engine.max_model_len, engine.pool.num_blocks, scratch
    )
    print(f"   (verify graphs {shapes} captured in {seconds:.1f} s)")


def forced_accept(rate: float, seed: int):  # noqa: ANN201
    """A greedy acceptance rule that takes each draft while a seeded coin lands under `rate`, then the
    target's own token at the first row not taken."""
    rng = random.Random(seed)

    def accept(logits: torch.Tensor, drafts: Sequence[int]) -> list[int]:
        m = 0
        while m < len(drafts) and rng.random() < rate:
            m += 1
        return [*drafts[:m], int(logits[m].argmax())]

    return accept


def decode_rate(engine: LLMEngine, batch: int, args: argparse.Namespace, skip: int = 0) -> float:
    """Output tokens/s of the decode part (after every request has its first token, and `skip` more
    steps: each gives every request one token where nothing is drafted)."""
    params = SamplingParams(temperature=0, max_tokens=args.decode_tokens, ignore_eos=True)
    vocab = engine.model_config.vocab_size
    ids = [engine.add_request(p, params) for p in prompts(batch, args.prompt_len, 100 + batch, vocab)]
    while any(r in engine.requests and not engine.requests[r].output_token_ids for r in ids):
        engine.step()
    for _ in range(skip):
        engine.step()
    sync(engine.device.type)
    t0 = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    sync(engine.device.type)
    return batch * (args.decode_tokens - 1 - skip) / (time.perf_counter() - t0)


def backoff_engines(args: argparse.Namespace) -> tuple[LLMEngine, LLMEngine]:
    """(plain, mtp) engines for `--backoff`: the same weights, the default drafting cap."""
    dev = args.device
    model = args.model or (MODEL if dev == "cuda" else CPU_MODEL)
    batch, max_len = args.backoff_batch, args.prompt_len + args.decode_tokens + 16
    kv = 2 * batch * max_len * 64 * 2**10 + 2**28 if dev == "cuda" else 256 << 20

    def cfg(spec: dict | None) -> EngineConfig:
        return EngineConfig(model=model, device=dev, dtype="bfloat16" if dev == "cuda" else "float32",
                            max_model_len=max_len, max_num_seqs=batch, kv_cache_bytes=kv, progress=False,
                            max_num_batched_tokens=max(batch * args.prompt_len, 2048),
                            enable_prefix_caching=False, speculative_config=spec)  # fmt: skip

    k = max(int(k) for k in args.ks.split(","))
    plain = LLMEngine(cfg(None), tokenizer=None)
    # the same weights: shared on CUDA; on the CPU each engine lays out its own (random: sources are seeded)
    shared = plain.loaded if dev == "cuda" else None
    mtp = LLMEngine(cfg({"method": "mtp", "num_speculative_tokens": k}), tokenizer=None, loaded=shared)
    return plain, mtp


def backoff(args: argparse.Namespace) -> None:
    """`method: mtp` at a batch past the default drafting cap against plain decoding, alternating: over
    the whole decode, and past the head's grace (the same steps skipped in both). `--backoff-ab` adds
    mtp with a head that never stops (its grace endless: every step catches up, as before the
    head's back-off)."""
    plain, spec = backoff_engines(args)
    sd, batch, graphs = spec.spec, args.backoff_batch, spec.runner.head_graphs
    assert sd is not None and sd.mtp is not None
    grace = sd.head_grace if args.head_grace is None else args.head_grace
    forwards: Counter = Counter()  # the head's eager forwards (a graph replay runs none)
    sd.mtp.head.register_forward_hook(lambda *_: forwards.update(["head"]))
    dev = spec.device.type
    name = torch.cuda.get_device_name() if dev == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(f"{name}: {spec.model_path}, batch {batch}, prompts of {args.prompt_len} tokens, "
          f"{args.decode_tokens} tokens a request; disable_by_batch_size "
          f"{sd.config.disable_by_batch_size}, the head's grace {grace} steps, head graphs "
          f"{'on' if graphs is not None else 'off'}")  # fmt: skip
    modes = ["plain", "mtp", "mtp, head never stops"][: 3 if args.backoff_ab else 2]
    counts: dict[str, Counter] = {m: Counter() for m in modes}

    def run(mode: str, skip: int) -> float:
        if mode == "plain":
            return decode_rate(plain, batch, args, skip)
        sd.head_grace = grace if mode == "mtp" else 10**9
        forwards.clear()
        replays, before = graphs.replays if graphs is not None else 0, sd.stats()
        rate = decode_rate(spec, batch, args, skip)
        after = sd.stats()
        replays = (graphs.replays if graphs is not None else 0) - replays
        lost = after.num_head_lost - before.num_head_lost
        counts[mode].update({"eager forwards": forwards["head"], "graph replays": replays,
                             "drafts verified": after.num_drafts - before.num_drafts,
                             "requests that lost it": lost})  # fmt: skip
        return rate

    for mode in modes:  # warm-up (first-use costs, the allocator)
        run(mode, 0)
    for skip in (0, grace + 1) if grace + 2 < args.decode_tokens else (0,):
        rates: dict[str, list[float]] = {m: [] for m in modes}
        for c in counts.values():
            c.clear()
        for i in range(args.backoff_repeats):  # the order turns each time: the host's load drifts
            for mode in modes[i % len(modes) :] + modes[: i % len(modes)]:
                rates[mode].append(run(mode, skip))
        base = statistics.median(rates["plain"])
        part = "the whole decode" if not skip else f"past {skip} steps"
        print(f"-- batch {batch}, drafting backed off, {part} (median of {args.backoff_repeats} runs each)")
        for mode in modes:
            rate = statistics.median(rates[mode])
            head = ", ".join(f"{k} {v}" for k, v in counts[mode].items())
            print(f"   {mode:22s} {rate:9.1f} tok/s {[round(r) for r in rates[mode]]}  ratio to plain "
                  f"{rate / base:5.3f}x" + (f"  (the head: {head})" if head else ""))  # fmt: skip


def profile_spec(engine: LLMEngine, args: argparse.Namespace, top: int) -> None:
    """One batch-1 decode with mtp under torch.profiler (the kernels, the GPU's idle gaps) and
    cProfile (the host's time), then the places it waits on the GPU."""
    import cProfile
    import pstats

    from torch.profiler import ProfilerActivity, profile

    from bench.profile_prefill import gaps

    short = argparse.Namespace(**{**vars(args), "decode_tokens": 16})
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        decode_rate(engine, 1, short)
    events = prof.key_averages()
    print(events.table(sort_by="self_device_time_total", row_limit=top, max_name_column_width=60))
    print(events.table(sort_by="self_cpu_time_total", row_limit=top, max_name_column_width=60))
    gaps(prof.events())
    with cProfile.Profile() as cp:
        decode_rate(engine, 1, short)
    pstats.Stats(cp).sort_stats("tottime").print_stats(25)
    pstats.Stats(cp).sort_stats("cumtime").print_stats(40)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ks", default="1,2,3")
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--acceptance", type=float, default=0.6, help="forced per-draft acceptance")
    ap.add_argument("--profile", type=int, default=0, metavar="TOP", help="profile one batch-1 mtp decode")
    ap.add_argument("--head-ab", action="store_true", help="mtp rows with the head's graphs off too")
    ap.add_argument("--backoff", action="store_true", help="only mtp backed off against plain, at one batch")
    ap.add_argument("--backoff-batch", type=int, default=32)
    ap.add_argument("--backoff-repeats", type=int, default=4, help="runs of each mode, alternating")
    ap.add_argument("--head-grace", type=int, default=None, help="--backoff's (default: the engine's)")
    ap.add_argument("--backoff-ab", action="store_true", help="--backoff with a head that never stops too")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", help="--backoff's")
    ap.add_argument("--model", default=None, help=f"--backoff's (default {MODEL}; on the CPU {CPU_MODEL})")
    args = ap.parse_args()
    if args.backoff:
        backoff(args)
        return 0
    if not torch.cuda.is_available():
        print("spec_verify_gpu: skipped (needs a CUDA device)")
        return 0
    ks = [int(k) for k in args.ks.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    t0 = time.perf_counter()
    plain = LLMEngine(config(args, None), tokenizer=None)
    print(f"{torch.cuda.get_device_name()}: {MODEL} bf16, prompts of {args.prompt_len} tokens "
          f"(built in {time.perf_counter() - t0:.0f} s)")  # fmt: skip
    print("-- step cost (ModelRunner.execute, median of", args.iters, "runs)")
    capture_verify_graphs(plain, ks, batches)
    for b in batches:
        step_costs(plain, b, ks, args)
    print(f"-- decode tokens/s, {args.decode_tokens} tokens a request, mtp acceptance forced to "
          f"{args.acceptance:.2f} a draft")  # fmt: skip
    base = {b: decode_rate(plain, b, args) for b in batches}
    spec_cfg = {"method": "mtp", "num_speculative_tokens": max(ks)}
    spec = LLMEngine(config(args, spec_cfg), tokenizer=None, loaded=plain.loaded)
    assert spec.spec is not None
    verify.accept_greedy = forced_accept(args.acceptance, seed=0)  # the verify step's greedy rule
    head_graphs = spec.runner.head_graphs  # the MTP head's CUDA graphs (engine/spec/mtp_graphs.py)
    for k in ks:
        spec.spec.k = k
        for b in batches:
            for graphed in (True, False) if args.head_ab else (True,):
                spec.runner.head_graphs = head_graphs if graphed else None
                before = spec.spec.stats()
                rate = decode_rate(spec, b, args)
                after = spec.spec.stats()
                drafted = after.num_draft_tokens - before.num_draft_tokens
                accepted = after.num_accepted_tokens - before.num_accepted_tokens
                head = "head graphs" if graphed and head_graphs is not None else "head eager "
                acc = f"acceptance {accepted / max(drafted, 1):.2f}"
                print(f"batch {b:3d}  k={k}: mtp {rate:8.1f} tok/s ({head})   plain {base[b]:8.1f} tok/s   "
                      f"ratio {rate / base[b]:5.2f}x   {acc}")  # fmt: skip
    spec.runner.head_graphs = head_graphs
    if args.profile:
        spec.spec.k = max(ks)
        profile_spec(spec, args, args.profile)
    print(f"total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
