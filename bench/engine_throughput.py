"""Offline throughput: splitserve's continuous batching vs Hugging Face `generate`, same weights.

Workload: N requests of random prompt token ids, prompt lengths uniform in [64, 512] and output lengths
uniform in [16, 128] (seeded); every request runs exactly its output length (greedy, ignore_eos).

* splitserve: all requests are handed to `LLM.generate` at once (continuous batching).
* HF baseline: left-padded batches of `--hf-batch-size` in arrival order, `max_new_tokens` = the longest
  output in the batch. Only each request's own output tokens count (what a user who needs the longest
  one gets); HF's raw generated tokens/s is printed too.

Examples:
    python bench/engine_throughput.py                                  # default GGUF model, CPU fp32
    python bench/engine_throughput.py --model tiny-random --num-requests 8
    python bench/engine_throughput.py --model qwen3-8b-random --device cuda   # random bf16 Qwen3-8B

Needs only torch and transformers on a GPU box (gguf only for GGUF models; tqdm optional).
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from splitserve.config.engine import EngineConfig
from splitserve.engine.config import block_bytes  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.engine.llm import LLM  # noqa: E402
from splitserve.model.loader import LoadedModel, load_model, resolve_model_path  # noqa: E402
from splitserve.model.random_weights import (  # noqa: E402
    RANDOM_SHAPES,
    build_hf_model,
    random_model,
    random_model_config,
)
from splitserve.sampling.params import SamplingParams  # noqa: E402

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - progress bars are optional
    tqdm = None

BLOCK_SIZE = 16
PEAK_HBM_BYTES_S = {"H200": 4.8e12, "H100": 3.35e12, "A100": 2.0e12}


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def prompt_tokens(self) -> int:
        return sum(len(p) for p in self.prompts)

    @property
    def output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class Result:
    system: str
    requests: int
    prompt_tokens: int
    output_tokens: int
    wall_s: float
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def output_tps(self) -> float:
        return self.output_tokens / self.wall_s

    @property
    def total_tps(self) -> float:
        return (self.prompt_tokens + self.output_tokens) / self.wall_s


# ---------------------------------------------------------------------------------------- setup


def parse_range(text: str) -> tuple[int, int]:
    lo, _, hi = text.partition("-")
    lo_i, hi_i = int(lo), int(hi or lo)
    if not 1 <= lo_i <= hi_i:
        raise argparse.ArgumentTypeError(f"bad range {text!r}: want N or LO-HI with 1 <= LO <= HI")
    return lo_i, hi_i


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--model", default="default", help=f"default | {' | '.join(RANDOM_SHAPES)} | <path>")
    ap.add_argument("--num-requests", type=int, default=64)
    ap.add_argument("--prompt-len", type=parse_range, default=(64, 512), help="LO-HI, uniform")
    ap.add_argument("--output-len", type=parse_range, default=(16, 128), help="LO-HI, uniform")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument(
        "--hf-batch-size",
        type=int,
        default=None,
        help="HF generate batch size (default: 16 on CPU, all requests at once on CUDA)",
    )
    ap.add_argument("--skip-hf", action="store_true", help="run splitserve only")
    ap.add_argument("--detokenize", action="store_true", help="splitserve detokenizes (HF never does)")
    ap.add_argument("--profile", metavar="OUT.prof", help="cProfile the timed splitserve run")
    ap.add_argument("--json", metavar="OUT.json", help="write the results as JSON")
    return ap.parse_args(argv)


def pick_device(arg: str) -> torch.device:
    if arg == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(arg)


def make_workload(
    n: int, prompt_range: tuple[int, int], output_range: tuple[int, int], vocab: int, seed: int
) -> Workload:
    rng = np.random.default_rng(seed)
    prompt_lens = rng.integers(prompt_range[0], prompt_range[1] + 1, size=n)
    output_lens = rng.integers(output_range[0], output_range[1] + 1, size=n)
    prompts = [rng.integers(0, vocab, size=int(p)).tolist() for p in prompt_lens]
    return Workload(prompts, [int(o) for o in output_lens])


def load_splitserve_model(args: argparse.Namespace, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    max_len = EngineConfig().resolve_max_model_len
    if args.model in RANDOM_SHAPES:
        return random_model(random_model_config(args.model), device, dtype, max_len, seed=args.seed)
    return load_model(resolve_model_path(args.model), device, dtype, max_len)


def load_hf_model(args: argparse.Namespace, loaded: LoadedModel, dtype: torch.dtype) -> torch.nn.Module:
    """The same weights in HF transformers: rebuilt from ours (random) or read from the same file."""
    if args.model in RANDOM_SHAPES:
        return build_hf_model(random_model_config(args.model), loaded.model)
    from transformers import AutoModelForCausalLM

    path = Path(resolve_model_path(args.model)).expanduser().resolve()
    device = next(loaded.model.parameters()).device
    if path.is_dir():
        hf = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    else:
        hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype)
    return hf.to(device).eval()


def make_engine(
    args: argparse.Namespace, loaded: LoadedModel, workload: Workload, dtype: torch.dtype
) -> LLMEngine:
    """An engine whose KV pool holds the whole workload (plus a quarter), sized explicitly so that the
    HF model fits beside it on a GPU."""
    blocks = sum(
        -(-(len(p) + o) // BLOCK_SIZE) for p, o in zip(workload.prompts, workload.output_lens, strict=True)
    )
    kv_bytes = int(blocks * 1.25 + 64) * block_bytes(loaded.config, BLOCK_SIZE, dtype)
    config = EngineConfig(
        model=args.model, device=args.device, block_size=BLOCK_SIZE, kv_cache_bytes=kv_bytes, seed=args.seed
    )
    return LLMEngine(config, tokenizer=args.detokenize and args.model not in RANDOM_SHAPES, loaded=loaded)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def progress(items: Iterable[Any], total: int, desc: str) -> Iterable[Any]:
    return tqdm(items, total=total, desc=desc, unit="batch") if tqdm is not None else items


# ------------------------------------------------------------------------------------------ runs


def run_splitserve(
    engine: LLMEngine, workload: Workload, args: argparse.Namespace, device: torch.device
) -> Result:
    llm = LLM.from_engine(engine)
    vocab = engine.model_config.vocab_size
    warm = make_workload(4, (32, 64), (8, 8), vocab, seed=args.seed + 1)
    llm.generate(warm.prompts, SamplingParams(temperature=0, max_tokens=8, ignore_eos=True), use_tqdm=False)
    params = [
        SamplingParams(temperature=0, max_tokens=o, ignore_eos=True, detokenize=args.detokenize)
        for o in workload.output_lens
    ]
    steps = count_calls(engine, "step")
    profiler = cProfile.Profile() if args.profile else None
    synchronize(device)
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    outs = llm.generate(workload.prompts, params, use_tqdm=tqdm is not None)
    synchronize(device)
    wall = time.perf_counter() - t0
    if profiler is not None:
        profiler.disable()
        dump_profile(profiler, args.profile)
    produced = sum(len(o.outputs[0].token_ids) for o in outs)
    if produced != workload.output_tokens:
        raise RuntimeError(f"splitserve produced {produced} tokens, expected {workload.output_tokens}")
    extra = {"engine_steps": steps[0], "preemptions": engine.scheduler.num_preemptions}
    return Result("splitserve", len(outs), workload.prompt_tokens, produced, wall, extra)


def count_calls(obj: Any, name: str) -> list[int]:
    """Wrap obj.name (instance attribute) to count its calls; returns the live counter [n]."""
    counter = [0]
    inner: Callable[..., Any] = getattr(obj, name)

    def counted(*a: Any, **kw: Any) -> Any:
        counter[0] += 1
        return inner(*a, **kw)

    setattr(obj, name, counted)
    return counter


def dump_profile(profiler: cProfile.Profile, path: str) -> None:
    profiler.dump_stats(path)
    print(f"\ncProfile of the splitserve run -> {path}; top 25 by internal time:")
    pstats.Stats(profiler).sort_stats("tottime").print_stats(25)


def hf_generate(hf: torch.nn.Module, prompts: list[list[int]], max_new: int, device: torch.device) -> int:
    """One left-padded greedy batch; returns the generated length (== max_new, EOS disabled)."""
    width = max(len(p) for p in prompts)
    ids = torch.zeros((len(prompts), width), dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    with torch.inference_mode():
        out = hf.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            max_new_tokens=max_new,
            do_sample=False,
            pad_token_id=0,
        )
    return out.shape[1] - width


def run_hf(
    hf: torch.nn.Module, workload: Workload, batch_size: int, device: torch.device, seed: int
) -> Result:
    hf.generation_config.eos_token_id = None  # every request runs its full length, like ignore_eos
    hf.generation_config.pad_token_id = 0
    vocab = int(hf.config.vocab_size)
    warm = make_workload(2, (32, 64), (8, 8), vocab, seed=seed + 1)
    hf_generate(hf, warm.prompts, 8, device)
    n = len(workload.prompts)
    starts = range(0, n, batch_size)
    raw = padded_prompt = 0
    synchronize(device)
    t0 = time.perf_counter()
    for s in progress(starts, len(starts), f"HF generate (bs={batch_size})"):
        prompts, outs = workload.prompts[s : s + batch_size], workload.output_lens[s : s + batch_size]
        got = hf_generate(hf, prompts, max(outs), device)
        if got != max(outs):
            raise RuntimeError(f"HF generated {got} tokens, expected {max(outs)} (did EOS stop it?)")
        raw += got * len(prompts)
        padded_prompt += max(len(p) for p in prompts) * len(prompts)
    synchronize(device)
    wall = time.perf_counter() - t0
    extra = {"batch_size": batch_size, "raw_generated_tokens": raw, "padded_prompt_tokens": padded_prompt}
    return Result(
        f"HF generate bs={batch_size}", n, workload.prompt_tokens, workload.output_tokens, wall, extra
    )


# --------------------------------------------------------------------------------------- report


def hbm_estimate(
    loaded: LoadedModel, workload: Workload, result: Result, dtype: torch.dtype
) -> dict[str, float]:
    """Lower bound on useful HBM traffic: all weights once per engine step + each decode token's KV."""
    cfg = loaded.config
    weight_bytes = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    kv_per_token = block_bytes(cfg, 1, dtype)
    kv_tokens = sum(
        o * len(p) + o * (o - 1) // 2 for p, o in zip(workload.prompts, workload.output_lens, strict=True)
    )
    total = result.extra["engine_steps"] * weight_bytes + kv_tokens * kv_per_token
    out = {"est_bytes": float(total), "achieved_bytes_s": total / result.wall_s}
    name = torch.cuda.get_device_name()
    peak = next((v for k, v in PEAK_HBM_BYTES_S.items() if k in name), None)
    if peak:
        out["peak_bytes_s"] = peak
        out["share_of_peak"] = out["achieved_bytes_s"] / peak
    return out


def print_table(results: list[Result]) -> None:
    head = f"{'system':<22}{'requests':>9}{'prompt tok':>12}{'output tok':>12}{'wall s':>9}"
    print("\n" + head + f"{'output tok/s':>14}{'total tok/s':>13}")
    for r in results:
        print(
            f"{r.system:<22}{r.requests:>9}{r.prompt_tokens:>12}{r.output_tokens:>12}{r.wall_s:>9.2f}"
            f"{r.output_tps:>14.1f}{r.total_tps:>13.1f}"
        )


def print_notes(results: list[Result]) -> None:
    ours = results[0]
    print(f"splitserve: {ours.extra['engine_steps']} engine steps, {ours.extra['preemptions']} preemptions")
    for r in results[1:]:
        raw, padded = r.extra["raw_generated_tokens"], r.extra["padded_prompt_tokens"]
        print(
            f"{r.system}: raw generated {raw} tokens ({raw - r.output_tokens} past their request's "
            f"length) = {raw / r.wall_s:.1f} tok/s raw; padded prompt tokens {padded}"
        )
        print(f"ratio splitserve/HF = {ours.output_tps / r.output_tps:.2f}x (output tok/s; goal >= 2x)")
    if "hbm" in ours.extra:
        hbm = ours.extra["hbm"]
        share = f" = {hbm['share_of_peak']:.1%} of peak" if "share_of_peak" in hbm else ""
        print(
            f"splitserve HBM (weights per step + decode KV, lower bound): "
            f"{hbm['achieved_bytes_s'] / 1e12:.2f} TB/s{share}"
        )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    device = pick_device(args.device)
    args.device = str(device)
    dtype = EngineConfig().torch_dtype(device)  # fp32 on CPU, bf16 on CUDA: same for both systems
    loaded = load_splitserve_model(args, device, dtype)
    cfg = loaded.config
    workload = make_workload(args.num_requests, args.prompt_len, args.output_len, cfg.vocab_size, args.seed)
    print(
        f"model {args.model} ({cfg.architecture}, {cfg.num_layers} layers, hidden {cfg.hidden_size}) "
        f"on {device} {dtype}; {torch.get_num_threads()} threads; {len(workload.prompts)} requests, "
        f"{workload.prompt_tokens} prompt + {workload.output_tokens} output tokens"
    )
    hf = None if args.skip_hf else load_hf_model(args, loaded, dtype)
    engine = make_engine(args, loaded, workload, dtype)
    results = [run_splitserve(engine, workload, args, device)]
    if device.type == "cuda":
        results[0].extra["hbm"] = hbm_estimate(loaded, workload, results[0], dtype)
    del engine
    if hf is not None:
        args.hf_batch_size = args.hf_batch_size or (16 if device.type == "cpu" else len(workload.prompts))
        results.append(run_hf(hf, workload, args.hf_batch_size, device, args.seed))
    print_table(results)
    print_notes(results)
    if args.json:
        rows = [{**asdict(r), "output_tps": r.output_tps, "total_tps": r.total_tps} for r in results]
        report = {"args": {k: v for k, v in vars(args).items()}, "results": rows}
        if len(results) > 1:
            report["ratio"] = results[0].output_tps / results[1].output_tps
        Path(args.json).write_text(json.dumps(report, indent=2, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
