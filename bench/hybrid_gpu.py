"""Qwen3.5 hybrid: prefill tok/s and decode tok/s (apart from prefill), splitserve vs HF, same weights.

HF transformers' `Qwen3_5ForCausalLM` is built with random bf16 weights on the device (its torch
fallback for the Gated DeltaNet: no flash-linear-attention kernels), and splitserve's `Qwen3_5LM`
loads the very same tensors. For each batch size: B prompts of `--prompt-len` random tokens, then
`--decode-tokens` greedy tokens each.

  Both warm up once at the measured shape first (kernels compiled and tuned, cuBLAS/Triton loaded).
  * prefill tok/s: B * prompt_len / time of the prefill (HF: one forward with a cache; splitserve:
    the engine steps until every request has its first token).
  * decode tok/s: B * (decode_tokens - 1) / time of the decode-only part (HF: generate() time minus
    its prefill; splitserve: the engine steps after the last prefill).
  * roofline: bytes read per decode step (weights + recurrent state + KV) / bandwidth measured here.

  * prefill repeats: for the largest batch, `--prefill-repeats` more prefills of fresh prompts (first
    token only), at the engine's token budget and at each `--extra-budgets` one: median prompt tok/s
    and every run's, so one slow run cannot pass for the figure.
  * single prefill: one `--single-prefill`-token prompt alone (ms), with its achieved TFLOP/s against
    the bf16 matmul rate measured in the run (8192^3 GEMM).
  * `--skip-hf`: splitserve's rows only (an A/B of splitserve's own changes in one run).

    python bench/hybrid_gpu.py --shape 9b            # Qwen3.5-9B shape on CUDA
    python bench/hybrid_gpu.py --shape 9b --single-prefill 4096 --linear-backend fla
    python bench/hybrid_gpu.py --shape 9b --single-prefill 4096 --extra-budgets 16384 --skip-hf
    python bench/hybrid_gpu.py --shape tiny --device cpu --batches 1,4 --prompt-len 64
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.model.config import ModelConfig  # noqa: E402
from splitserve.model.loader import LoadedModel  # noqa: E402
from splitserve.model.qwen3_5 import Qwen3_5LM  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402

SHAPES = {
    # Qwen3.5-9B text model: 32 layers (24 Gated DeltaNet + 8 gated attention), hidden 4096
    "9b": dict(vocab_size=248320, hidden_size=4096, intermediate_size=12288, num_hidden_layers=32,
               num_attention_heads=16, num_key_value_heads=4, head_dim=256, linear_num_key_heads=16,
               linear_num_value_heads=32, linear_key_head_dim=128, linear_value_head_dim=128),
    "tiny": dict(vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32, linear_num_key_heads=2,
                 linear_num_value_heads=4, linear_key_head_dim=16, linear_value_head_dim=16),
}  # fmt: skip


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def build_models(shape: str, device: torch.device, dtype: torch.dtype, max_len: int, hf_fla: bool):  # noqa: ANN201
    # NOTE: transformers' Qwen3.5 picks fla's kernels at import when fla is importable; the baseline is
    # its torch fallback unless --hf-fla, so `fla` is hidden while its modeling module is imported.
    hidden = not hf_fla and "transformers.models.qwen3_5.modeling_qwen3_5" not in sys.modules
    if hidden:
        sys.modules["fla"] = None  # type: ignore[assignment]
    try:
        from transformers import Qwen3_5ForCausalLM, Qwen3_5TextConfig
        from transformers.models.qwen3_5 import modeling_qwen3_5  # noqa: F401
    finally:
        if hidden:
            del sys.modules["fla"]

    cfg = Qwen3_5TextConfig(**SHAPES[shape], max_position_embeddings=max_len)
    torch.manual_seed(0)
    with torch.device(device):
        hf = Qwen3_5ForCausalLM._from_config(cfg, dtype=dtype).eval()
    mcfg = ModelConfig.from_hf({**cfg.to_dict(), "architectures": ["Qwen3_5ForCausalLM"]})
    with torch.device("meta"):
        ours = Qwen3_5LM(mcfg, max_len).to(dtype)
    ours = ours.to_empty(device=device)
    ours.load_weights(hf.state_dict().items())
    ours.build_rope(max_len, device)
    return hf, LoadedModel(ours.eval(), mcfg, None, 0.0)


def bench_hf(hf, prompts: torch.Tensor, decode_tokens: int) -> tuple[float, float]:  # noqa: ANN001
    dev = prompts.device
    with torch.inference_mode():
        hf(prompts.roll(1, dims=1), use_cache=True)  # warm-up at the measured shape
        sync(dev)
        t0 = time.perf_counter()
        hf(prompts, use_cache=True)
        sync(dev)
        prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        out = hf.generate(
            prompts, attention_mask=torch.ones_like(prompts), max_new_tokens=decode_tokens,
            min_new_tokens=decode_tokens, do_sample=False, eos_token_id=None, pad_token_id=0,
        )  # fmt: skip
        sync(dev)
        total = time.perf_counter() - t0
    assert out.shape[1] == prompts.shape[1] + decode_tokens
    return prefill, max(total - prefill, 1e-9)


def bench_ours(engine: LLMEngine, prompts: torch.Tensor, decode_tokens: int) -> tuple[float, float]:
    params = SamplingParams(temperature=0, max_tokens=decode_tokens, ignore_eos=True)
    dev = prompts.device
    for p in prompts.roll(1, dims=1).tolist():  # warm-up at the measured shape (other tokens)
        engine.add_request(p, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))
    while engine.has_unfinished_requests():
        engine.step()
    sync(dev)
    reqs = [engine.add_request(p, params) for p in prompts.tolist()]
    t0 = time.perf_counter()
    prefill = None
    done = 0
    while engine.has_unfinished_requests():
        outs = engine.step()
        if prefill is None and all(engine.requests[r].output_token_ids for r in reqs if r in engine.requests):
            sync(dev)
            prefill = time.perf_counter() - t0
            t_dec = time.perf_counter()
        done += sum(o.finished for o in outs)
    sync(dev)
    assert done == len(reqs) and prefill is not None
    return prefill, time.perf_counter() - t_dec


def decode_bytes_per_step(loaded: LoadedModel, batch: int, ctx: int) -> float:
    cfg = loaded.config
    weights = sum(p.numel() * p.element_size() for p in loaded.model.parameters())
    weights -= loaded.model.embed_tokens.weight.numel() * loaded.model.embed_tokens.weight.element_size()
    state = sum(
        2 * batch * torch.Size(shape).numel() * 4 for shape, _ in loaded.model.state_shapes().values()
    )  # fp32 state read and written
    kv = batch * ctx * cfg.num_kv_layers * 2 * cfg.num_kv_heads * cfg.head_dim * 2
    return weights + state + kv


def measured_bandwidth(device: torch.device) -> float:
    if device.type != "cuda":
        return float("nan")
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    y.copy_(x)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(10):
        y.copy_(x)
    sync(device)
    return 10 * 2 * x.numel() / (time.perf_counter() - t0)


def matmul_rate(device: torch.device) -> float:
    """bf16 FLOP/s of one 8192^3 GEMM on random data (median of 10), the compute ceiling here."""
    if device.type != "cuda":
        return float("nan")
    a, b = (torch.randn(8192, 8192, device=device, dtype=torch.bfloat16) for _ in range(2))
    times = []
    for _ in range(12):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        a @ b
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    return 2 * 8192**3 / sorted(times[2:])[5]


def prefill_flops(loaded: LoadedModel, tokens: int) -> float:
    """Matmul FLOPs of one prompt: 2 x non-embedding weights x tokens, plus causal attention."""
    cfg = loaded.config
    weights = sum(p.numel() for p in loaded.model.parameters())
    weights -= loaded.model.embed_tokens.weight.numel()
    if loaded.model.lm_head is not None:
        weights -= loaded.model.lm_head.weight.numel()
    attn = cfg.num_kv_layers * 2 * tokens * tokens * cfg.num_heads * cfg.head_dim  # QK^T + PV, causal half
    return 2 * weights * tokens + attn


def prefill_repeats(engine: LLMEngine, batch: int, length: int, vocab: int, repeats: int) -> list[float]:
    """Seconds of `repeats` prefills of `batch` fresh `length`-token prompts (until every first token),
    after one untimed at the same shape."""
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    g = torch.Generator().manual_seed(length + batch)
    times = []
    for i in range(repeats + 1):
        prompts = torch.randint(0, vocab, (batch, length), generator=g).tolist()
        sync(engine.device)
        t0 = time.perf_counter()
        for p in prompts:
            engine.add_request(p, params)
        while engine.has_unfinished_requests():
            engine.step()
        sync(engine.device)
        if i:
            times.append(time.perf_counter() - t0)
    return times


def print_repeats(batch: int, length: int, budget: int, times: list[float]) -> None:
    n = batch * length
    runs = ", ".join(f"{n / t:.0f}" for t in times)
    print(
        f"{batch} x {length} prefill, budget {budget} tokens: median {n / statistics.median(times):.0f} "
        f"prompt tok/s over {len(times)} runs (min {n / max(times):.0f}, max {n / min(times):.0f}; "
        f"runs: {runs})"
    )


def single_prefill(engine: LLMEngine, hf, n: int, vocab: int, device: torch.device) -> None:  # noqa: ANN001
    """Time one n-token prompt alone (median of 5): splitserve's first token vs HF's forward (`hf` None:
    splitserve alone)."""
    g = torch.Generator().manual_seed(n)
    prompt = torch.randint(0, vocab, (1, n), generator=g).to(device)
    ours, theirs = [], []
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    for _ in range(6):
        sync(device)
        t0 = time.perf_counter()
        engine.add_request(prompt[0].tolist(), params)
        while engine.has_unfinished_requests():
            engine.step()
        sync(device)
        ours.append(time.perf_counter() - t0)
        with torch.inference_mode():
            t0 = time.perf_counter()
            if hf is not None:
                hf(prompt, use_cache=True)
            sync(device)
            theirs.append(time.perf_counter() - t0)
    ours_s, hf_s = statistics.median(ours[1:]), statistics.median(theirs[1:])
    flops, rate = prefill_flops(engine.loaded, n), matmul_rate(device)
    vs_hf = f", HF {hf_s * 1e3:.1f} ms (HF/splitserve = {hf_s / ours_s:.2f}x)" if hf is not None else ""
    print(
        f"single prefill of {n} tokens: splitserve {ours_s * 1e3:.1f} ms (median of 5: "
        f"{', '.join(f'{t * 1e3:.1f}' for t in ours[1:])}){vs_hf}; {flops / ours_s / 1e12:.0f} TFLOP/s = "
        f"{flops / ours_s / rate:.1%} of the bf16 matmul rate measured here ({rate / 1e12:.0f} TFLOP/s)"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="9b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=64)
    ap.add_argument("--batches", default="1,32")
    ap.add_argument("--single-prefill", type=int, default=0, help="also time one prompt of this length")
    ap.add_argument("--linear-backend", default="auto", help="linear_attention_backend: auto|torch|fla")
    ap.add_argument("--max-batched-tokens", type=int, default=8192)
    ap.add_argument("--hf-fla", action="store_true", help="let HF use fla's kernels too (default: torch)")
    ap.add_argument("--skip-hf", action="store_true", help="splitserve's rows only")
    ap.add_argument("--prefill-repeats", type=int, default=5, help="more prefills of the largest batch")
    ap.add_argument("--extra-budgets", default="", help="token budgets to time those prefills at too")
    args = ap.parse_args()
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    max_len = max(args.prompt_len + args.decode_tokens, args.single_prefill) + 16
    hf, loaded = build_models(args.shape, device, dtype, max_len, args.hf_fla)
    bw = measured_bandwidth(device)
    print(
        f"Qwen3.5 {args.shape} on {device} {dtype}; copy bandwidth {bw / 1e12:.2f} TB/s; HF's gated delta "
        f"rule: {'fla' if args.hf_fla else 'torch fallback'}; ours: {args.linear_backend}"
    )
    print(f"{'batch':>5} {'system':>10} {'prefill tok/s':>14} {'decode tok/s':>13} {'decode roofline':>16}")
    batches = [int(b) for b in args.batches.split(",")]
    for batch in batches:
        engine = LLMEngine(
            make_config(args, dtype, max_len, batch, args.max_batched_tokens), tokenizer=False, loaded=loaded
        )
        g = torch.Generator().manual_seed(batch)
        prompts = torch.randint(0, loaded.config.vocab_size, (batch, args.prompt_len), generator=g).to(device)
        floor = decode_bytes_per_step(loaded, batch, args.prompt_len + args.decode_tokens // 2) / bw
        rows = {"splitserve": bench_ours(engine, prompts, args.decode_tokens)}
        if not args.skip_hf:
            rows["HF"] = bench_hf(hf, prompts, args.decode_tokens)
        for name, (pre, dec) in rows.items():
            dec_tps = batch * (args.decode_tokens - 1) / dec
            share = dec_tps / (batch / floor) if bw == bw else float("nan")
            pre_tps = batch * args.prompt_len / pre
            print(f"{batch:>5} {name:>10} {pre_tps:>14.1f} {dec_tps:>13.1f} {share:>15.1%}")
        if "HF" in rows:
            ratio = (rows["HF"][1]) / rows["splitserve"][1]
            print(f"{batch:>5} decode speed-up splitserve/HF = {ratio:.2f}x (goal >= 10x)")
            pre_ratio = rows["HF"][0] / rows["splitserve"][0]
            print(f"{batch:>5} prefill speed-up splitserve/HF = {pre_ratio:.2f}x")
        if batch == max(batches):
            budget = engine.config.max_num_batched_tokens
            vocab = loaded.config.vocab_size
            if args.prefill_repeats:
                times = prefill_repeats(engine, batch, args.prompt_len, vocab, args.prefill_repeats)
                print_repeats(batch, args.prompt_len, budget, times)
            if args.single_prefill:
                single_prefill(engine, None if args.skip_hf else hf, args.single_prefill, vocab, device)
            del engine
            for extra in [int(b) for b in args.extra_budgets.split(",") if b]:
                engine = LLMEngine(
                    make_config(args, dtype, max_len, batch, extra), tokenizer=False, loaded=loaded
                )
                times = prefill_repeats(engine, batch, args.prompt_len, vocab, args.prefill_repeats)
                print_repeats(batch, args.prompt_len, engine.config.max_num_batched_tokens, times)
                del engine
        else:
            del engine


def make_config(
    args: argparse.Namespace, dtype: torch.dtype, max_len: int, batch: int, budget: int
) -> EngineConfig:
    return EngineConfig(
        model=f"qwen3.5-{args.shape}-random", device=args.device, dtype=str(dtype).split(".")[1],
        max_model_len=max_len, max_num_seqs=max(batch, 2),
        max_num_batched_tokens=max(budget, args.single_prefill),
        linear_attention_backend=args.linear_backend, enable_prefix_caching=False,
        kv_cache_bytes=batch * max_len * 64 * 2**10 + 2**28, progress=False,
    )  # fmt: skip


if __name__ == "__main__":
    main()
