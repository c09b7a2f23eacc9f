"""The GPU fast path against the hardware's limits and HF transformers, random weights at real shapes.

Measured in one run, on one device, with the same bf16 weights for splitserve and HF:

* the device's memory bandwidth (a large device-to-device copy, bytes read + written over time) and
  its bf16 matmul rate (8192 x 8192 x 8192 products): the baselines every share below is of;
* batch-1 decode (prompt `--prompt-len`, `--decode-tokens` new tokens): tok/s of the decode steps,
  and the share of the weight-read floor (bandwidth / bytes of weights read per step);
* 128 sequences decoding together (prompt 512, 128 new tokens, so contexts of 512 to 640): output
  tok/s of the decode-only steps, and its share of the roofline for reading the weights plus every
  sequence's KV once per step; and the same 128 requests arriving at once, served start to finish
  (prefill included): output tok/s over the whole run;
* one `--prefill-len`-token prefill: time to first token, and the achieved matmul rate
  (2 x parameters x tokens + causal attention) as a share of the measured bf16 matmul rate;
* HF transformers (`generate`, eager, its own KV cache) on the same work: batch-1 decode tok/s,
  128 requests with `--hf-new-tokens` new tokens end to end, and the same prefill.

    python bench/gpu_engine.py                         # Qwen3-8B shape on CUDA (about 5 minutes)
    python bench/gpu_engine.py --shape tiny --device cpu --batch 4 --skip-hf   # smoke run anywhere

Needs torch and transformers (triton on CUDA); prints a table and writes `--out` as JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.model.random_weights import build_hf_model, random_model, random_model_config  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402

SHAPES = {"qwen3-8b": "qwen3-8b-random", "tiny": "tiny-random"}


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_bandwidth(device: torch.device, nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Bytes/s of a device-to-device copy, counting bytes read and written."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        dst.copy_(src)
    sync(device)
    return 2 * nbytes * iters / (time.perf_counter() - t0)


def measure_matmul(device: torch.device, n: int = 8192, iters: int = 10) -> float:
    """FLOP/s of n x n x n bf16 products on random data."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    for _ in range(3):
        a @ b
    sync(device)
    t0 = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - t0)


class StepLog:
    """Wraps the engine's model runner: per step, whether it was decode-only and how many rows."""

    def __init__(self, engine: LLMEngine) -> None:
        self.decode_only = False
        self.rows = 0
        inner = engine.runner.execute

        def execute(chunks, *rest):  # noqa: ANN001, ANN002, ANN202
            self.decode_only = all(c.num_tokens == 1 for c in chunks)
            self.rows = len(chunks)
            return inner(chunks, *rest)

        engine.runner.execute = execute  # type: ignore[method-assign]


def run_engine(engine: LLMEngine, prompts: list[list[int]], new_tokens: int) -> dict[str, float]:
    """All prompts at once; -> wall time, decode-only time and tokens, time to the first token."""
    log = StepLog(engine)
    params = SamplingParams(temperature=0, max_tokens=new_tokens, ignore_eos=True, detokenize=False)
    sync(engine.device)
    t0 = time.perf_counter()
    for p in prompts:
        engine.add_request(p, params)
    decode_s = 0.0
    decode_tokens = 0
    first_token_s = None
    out_tokens = 0
    while engine.has_unfinished_requests():
        log.rows = 0
        s0 = time.perf_counter()
        outs = engine.step()  # returns after the sampled ids of a step reach the host
        dt = time.perf_counter() - s0
        if log.decode_only or not log.rows:  # a step that ran nothing read an overlapped step's ids
            decode_s += dt
            decode_tokens += log.rows
        if first_token_s is None and outs:
            first_token_s = time.perf_counter() - t0
        out_tokens = sum(len(o.outputs[0].token_ids) for o in outs if o.finished) + out_tokens
    wall = time.perf_counter() - t0
    return {
        "wall_s": wall,
        "first_token_s": first_token_s or wall,
        "decode_s": decode_s,
        "decode_tokens": decode_tokens,
        "output_tokens": out_tokens,
        "decode_tok_s": decode_tokens / decode_s if decode_s else 0.0,
        "e2e_tok_s": out_tokens / wall,
    }


def batch1_without(
    engine: LLMEngine, knob: str, prompts: list[list[int]], new_tokens: int
) -> dict[str, float] | None:
    """Batch-1 decode with `knob` off ("FUSE": kernels/gemv.py's fusions; "PDL": kernels/pdl.py's
    programmatic dependent launch), decode graphs captured again without it and then with it: the A/B
    of this run. None when it is off anyway or there are no graphs."""
    from splitserve.kernels import gemv, pdl

    module, name = (gemv, "FUSE") if knob == "FUSE" else (pdl, "ENABLED")
    graphs = engine.runner.graphs
    if graphs is None or not (gemv.ENABLED and getattr(module, name)):
        return None
    setattr(module, name, False)
    graphs.capture()
    try:
        return run_engine(engine, prompts, new_tokens)
    finally:
        setattr(module, name, True)
        graphs.capture()


@torch.inference_mode()
def hf_generate(hf: torch.nn.Module, prompts: list[list[int]], new: int, device: torch.device) -> float:
    ids = torch.tensor(prompts, device=device)  # equal lengths: no padding needed
    sync(device)
    t0 = time.perf_counter()
    hf.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=new,
        min_new_tokens=new,
        do_sample=False,
        pad_token_id=0,
    )
    sync(device)
    return time.perf_counter() - t0


@torch.inference_mode()
def hf_prefill(hf: torch.nn.Module, prompt: list[int], device: torch.device) -> float:
    ids = torch.tensor([prompt], device=device)
    hf(ids, logits_to_keep=1)
    sync(device)
    t0 = time.perf_counter()
    hf(ids, logits_to_keep=1)
    sync(device)
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="qwen3-8b")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--prompt-len", type=int, default=512)
    ap.add_argument("--decode-tokens", type=int, default=256, help="new tokens in the batch-1 run")
    ap.add_argument("--batch", type=int, default=128)
    ap.add_argument("--batch-new-tokens", type=int, default=128)
    ap.add_argument("--prefill-len", type=int, default=4096)
    ap.add_argument("--hf-new-tokens", type=int, default=64, help="HF: new tokens (batch 1 and batch runs)")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument(
        "--max-num-batched-tokens", type=int, default=16384, help="tokens per step (vLLM's offline default)"
    )
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.6, help="leaves room for HF's copy")
    ap.add_argument("--enforce-eager", action="store_true", help="no CUDA graphs (to see what they give)")
    ap.add_argument("--out", default="bench/results/gpu_engine.json")
    args = ap.parse_args(argv)

    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    name = SHAPES[args.shape]
    hf_cfg = random_model_config(name)
    max_len = max(args.prefill_len, args.prompt_len + args.decode_tokens) + 16
    results: dict[str, Any] = {"shape": args.shape, "device": str(device), "dtype": str(dtype)}
    if device.type == "cuda":
        results["gpu"] = torch.cuda.get_device_name(device)

    print("measuring bandwidth and matmul rate ...", flush=True)
    bw = measure_bandwidth(device, (4 << 30) if device.type == "cuda" else (256 << 20))
    mm = measure_matmul(device, 8192 if device.type == "cuda" else 1024)
    results.update(bandwidth_GBps=bw / 1e9, matmul_TFLOPs=mm / 1e12)
    print(f"  copy bandwidth {bw / 1e9:.0f} GB/s, bf16 matmul {mm / 1e12:.0f} TFLOP/s", flush=True)

    loaded = random_model(hf_cfg, device, dtype, max_len)
    model = loaded.model
    cfg = loaded.config
    params = {n: p for n, p in model.named_parameters()}
    elem = torch.empty((), dtype=dtype).element_size()
    embed_bytes = params["embed_tokens.weight"].numel() * elem
    weight_bytes = sum(p.numel() for p in params.values()) * elem - embed_bytes  # read once a step
    lm_head_params = cfg.vocab_size * cfg.hidden_size
    matmul_params = weight_bytes // elem - lm_head_params  # all but the embedding and the LM head
    kv_per_token = 2 * cfg.num_kv_layers * cfg.num_kv_heads * cfg.head_dim * elem
    results.update(weight_GB=weight_bytes / 1e9, kv_bytes_per_token=kv_per_token)

    config = EngineConfig(
        model=name,
        device=str(device),
        max_num_seqs=max(args.batch, 1),
        max_num_batched_tokens=max(args.prefill_len, args.max_num_batched_tokens),
        max_model_len=max_len,
        gpu_memory_utilization=args.gpu_memory_utilization,
        kv_cache_bytes=None if device.type == "cuda" else 256 << 20,
        enforce_eager=args.enforce_eager,
        progress=False,
    )
    t0 = time.perf_counter()
    engine = LLMEngine(config, tokenizer=False, loaded=loaded)
    results.update(
        engine_init_s=time.perf_counter() - t0,
        graph_capture_s=engine.graph_capture_s,
        kv_blocks=engine.pool.num_blocks,
        attention=type(engine.runner.attn).__name__,
        cuda_graphs=engine.runner.graphs is not None,
    )
    print(f"  engine ready in {results['engine_init_s']:.1f} s ({results['attention']}, graphs "
          f"{results['cuda_graphs']}, {engine.pool.num_blocks} KV blocks)", flush=True)  # fmt: skip

    gen = torch.Generator().manual_seed(0)

    def prompts(n: int, length: int) -> list[list[int]]:
        return torch.randint(0, cfg.vocab_size, (n, length), generator=gen).tolist()

    run_engine(engine, prompts(2, 64), 8)  # warm-up (Triton compiles for prefill shapes)

    # batch 1, first with the host's work not overlapped with the GPU's (the baseline of this run)
    print("batch-1 decode ...", flush=True)
    one = prompts(1, args.prompt_len)
    overlap = engine.async_scheduling
    engine.async_scheduling = False
    r1_plain = run_engine(engine, one, args.decode_tokens)
    engine.async_scheduling = overlap
    r1 = run_engine(engine, prompts(1, args.prompt_len), args.decode_tokens)
    r1_sep = batch1_without(engine, "FUSE", prompts(1, args.prompt_len), args.decode_tokens)
    r1_nopdl = batch1_without(engine, "PDL", prompts(1, args.prompt_len), args.decode_tokens)
    ctx1 = args.prompt_len + args.decode_tokens / 2
    floor1 = bw / weight_bytes
    roof1 = bw / (weight_bytes + ctx1 * kv_per_token)
    results["batch1"] = {
        **r1,
        "not_overlapped_tok_s": r1_plain["decode_tok_s"],
        "unfused_tok_s": r1_sep["decode_tok_s"] if r1_sep else None,
        "no_pdl_tok_s": r1_nopdl["decode_tok_s"] if r1_nopdl else None,
        "weight_floor_tok_s": floor1,
        "share_of_weight_floor": r1["decode_tok_s"] / floor1,
        "roofline_tok_s": roof1,
        "share_of_roofline": r1["decode_tok_s"] / roof1,
    }

    # batch N together
    print(f"batch-{args.batch} ...", flush=True)
    many = prompts(args.batch, args.prompt_len)
    engine.async_scheduling = False
    rb_plain = run_engine(engine, many, args.batch_new_tokens)
    engine.async_scheduling = overlap
    rb = run_engine(engine, prompts(args.batch, args.prompt_len), args.batch_new_tokens)
    ctxb = args.prompt_len + args.batch_new_tokens / 2
    roofb = bw * args.batch / (weight_bytes + args.batch * ctxb * kv_per_token)
    results["batch"] = {
        **rb,
        "not_overlapped_tok_s": rb_plain["decode_tok_s"],
        "not_overlapped_e2e_tok_s": rb_plain["e2e_tok_s"],
        "batch": args.batch,
        "roofline_tok_s": roofb,
        "share_of_roofline": rb["decode_tok_s"] / roofb,
    }

    # one long prefill
    print(f"prefill of {args.prefill_len} tokens ...", flush=True)
    run_engine(engine, prompts(1, args.prefill_len), 1)  # warm-up of this shape
    long = prompts(1, args.prefill_len)  # a new prompt: no prefix-cache hits
    rp = run_engine(engine, long, 1)
    n = args.prefill_len
    flops = (
        2 * matmul_params * n
        + 2 * lm_head_params
        + 2 * n * n * cfg.head_dim * cfg.num_heads * len(cfg.kv_layer_ids)
    )
    results["prefill"] = {
        "tokens": n,
        "seconds": rp["first_token_s"],
        "tok_s": n / rp["first_token_s"],
        "TFLOPs": flops / rp["first_token_s"] / 1e12,
        "share_of_matmul": flops / rp["first_token_s"] / mm,
    }

    if not args.skip_hf:
        del engine
        torch.cuda.empty_cache() if device.type == "cuda" else None
        hf = build_hf_model(hf_cfg, model)
        print("HF transformers ...", flush=True)
        k = args.hf_new_tokens
        hf_generate(hf, prompts(1, 64), 4, device)  # warm-up
        t_pre = hf_generate(hf, one, 1, device)
        t_all = hf_generate(hf, one, k, device)
        hf1 = (k - 1) / max(t_all - t_pre, 1e-9)
        tb = hf_generate(hf, many, k, device)
        hp = hf_prefill(hf, long[0], device)
        results["hf"] = {
            "batch1_decode_tok_s": hf1,
            "batch_e2e_tok_s": args.batch * k / tb,
            "batch_new_tokens": k,
            "prefill_s": hp,
            "prefill_TFLOPs": flops / hp / 1e12,
        }

    b1, bb, pf = results["batch1"], results["batch"], results["prefill"]
    hf_res = results.get("hf", {})

    def vs(ours: float, key: str) -> str:
        return f"{ours / hf_res[key]:.1f}x" if key in hf_res else "-"

    rows = [
        ("batch-1 decode tok/s", f"{b1['decode_tok_s']:.0f}",
         f"{b1['share_of_weight_floor']:.0%} of weight floor {b1['weight_floor_tok_s']:.0f}",
         f"{hf_res.get('batch1_decode_tok_s', 0):.1f}", vs(b1["decode_tok_s"], "batch1_decode_tok_s")),
        (f"batch-{args.batch} decode tok/s", f"{bb['decode_tok_s']:.0f}",
         f"{bb['share_of_roofline']:.0%} of roofline {bb['roofline_tok_s']:.0f}", "-", "-"),
        (f"batch-{args.batch} end to end tok/s", f"{bb['e2e_tok_s']:.0f}",
         f"({args.batch_new_tokens} new tokens; HF {hf_res.get('batch_new_tokens', '-')})",
         f"{hf_res.get('batch_e2e_tok_s', 0):.0f}", vs(bb["e2e_tok_s"], "batch_e2e_tok_s")),
        (f"prefill {n} tokens, s", f"{pf['seconds']:.3f}",
         f"{pf['TFLOPs']:.0f} TFLOP/s = {pf['share_of_matmul']:.0%} of matmul {mm / 1e12:.0f}",
         f"{hf_res.get('prefill_s', 0):.3f}",
         f"{hf_res['prefill_s'] / pf['seconds']:.1f}x" if "prefill_s" in hf_res else "-"),
    ]  # fmt: skip
    print(f"\n{'':30} {'splitserve':>11}  {'share':50} {'HF':>8} {'ratio':>6}")
    for label, ours, share, hf_v, ratio in rows:
        print(f"{label:30} {ours:>11}  {share:50} {hf_v:>8} {ratio:>6}")
    print(
        f"\noverlapped steps (async_scheduling) against the same engine without, this run: batch-1 decode "
        f"{b1['decode_tok_s']:.0f} / {b1['not_overlapped_tok_s']:.0f} tok/s = "
        f"{b1['decode_tok_s'] / b1['not_overlapped_tok_s']:.2f}x; batch-{args.batch} decode "
        f"{bb['decode_tok_s']:.0f} / {bb['not_overlapped_tok_s']:.0f} = "
        f"{bb['decode_tok_s'] / bb['not_overlapped_tok_s']:.2f}x, end to end {bb['e2e_tok_s']:.0f} / "
        f"{bb['not_overlapped_e2e_tok_s']:.0f} = {bb['e2e_tok_s'] / bb['not_overlapped_e2e_tok_s']:.2f}x"
    )
    if b1["unfused_tok_s"]:
        print(
            f"batch 1 with the norms, SiLU and residual adds in the GEMVs against the same steps as "
            f"kernels of their own (SPLITSERVE_GEMV_FUSE=0), this run: {b1['decode_tok_s']:.0f} / "
            f"{b1['unfused_tok_s']:.0f} tok/s = {b1['decode_tok_s'] / b1['unfused_tok_s']:.3f}x"
        )
    if b1["no_pdl_tok_s"]:
        print(
            f"batch 1 with programmatic dependent launch against without "
            f"(SPLITSERVE_PDL=0), this run: {b1['decode_tok_s']:.0f} / {b1['no_pdl_tok_s']:.0f} "
            f"tok/s = {b1['decode_tok_s'] / b1['no_pdl_tok_s']:.3f}x"
        )
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(results, indent=2))
    print(f"\nwrote {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
