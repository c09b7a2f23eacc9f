"""The rate-inf burst against this box's floor for it, measured in the same run.

The load of `vllm bench serve --request-rate inf` on the default model (64 prompts of 256 at once, 64
tokens each at temperature 1) is replayed in one engine built as a served worker builds it (fp32, KV
prefaulted as an idle worker does it), `--runs` times with fresh prompts. The same process measures the
host's fp32 matmul rate (oneDNN, 2048^3, warm) and its read bandwidth, and counts the burst's work from
the model's shapes:

* products: every projection for every prompt token and decode row, the LM head for each prompt's last
  token and every decode row (2 FLOPs a multiply-add);
* prompt attention: causal QK^T and PV over each prompt;
* decode attention: each decode row reads its sequence's K and V for every layer (bytes at the read
  bandwidth, or its FLOPs at the matmul rate, whichever is slower).

The floor is the parts' sum, each at the box's measured rate: a serial model (compute and KV reads
could overlap, and the weights' and the KV writes' traffic is not counted), so not a strict lower
bound. The share is floor / achieved (the run's speed as a share of the floor's), and the ceiling is
the output tok/s the floor allows. `--vllm TOK_S` (vLLM-CPU's rate-inf output tok/s measured
on the same box) adds what `--goal` x that figure needs, as a share of the floor.

    python bench/cpu_burst_floor.py
    python bench/cpu_burst_floor.py --runs 3 --vllm 116.7
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too
sys.path.insert(0, str(Path(__file__).resolve().parent))

from cpu_engine import measure_host, weight_bytes  # noqa: E402

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402


def burst(engine: LLMEngine, prompts: int, plen: int, out: int, seed: int) -> tuple[float, float]:
    """One burst from an idle engine: -> (wall seconds, mean time to first token)."""
    vocab = engine.loaded.model.cfg.vocab_size
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_tokens=out, ignore_eos=True, detokenize=False)
    while engine.prefault.advance():  # an idle served worker maps its next KV pages the same way
        pass
    t0 = time.perf_counter()
    for q in torch.randint(0, vocab, (prompts, plen), generator=gen).tolist():
        engine.add_request(q, params)
    first: dict[str, float] = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            first.setdefault(o.request_id, time.perf_counter() - t0)
    return time.perf_counter() - t0, sum(first.values()) / len(first)


def work(engine: LLMEngine, prompts: int, plen: int, out: int) -> dict[str, float]:
    """The burst's work from the model's shapes: product and attention FLOPs, decode KV bytes."""
    cfg = engine.loaded.model.cfg
    _, params = weight_bytes(engine)  # projections + LM head, per token
    head = cfg.vocab_size * cfg.hidden_size
    proj = params - head
    rows = prompts * (out - 1)  # decode rows: the first token comes from the prompt's step
    layers, h, kvh, d = cfg.num_layers, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ctx = prompts * sum(range(plen + 1, plen + out))  # keys each decode row attends over, summed
    return {
        "products": 2 * proj * (prompts * plen + rows) + 2 * head * (prompts + rows),
        "prompt_attn": layers * prompts * 4 * h * d * plen * (plen + 1) / 2,
        "decode_attn_flops": layers * 4 * h * d * ctx,
        "decode_kv_bytes": layers * 2 * kvh * d * 4 * ctx,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--vllm", type=float, default=None, help="vLLM-CPU's rate-inf output tok/s on this box")
    ap.add_argument("--goal", type=float, default=1.25, help="the multiple of --vllm asked for")
    args = ap.parse_args()
    n, plen, out = args.prompts, args.prompt_len, args.output_len
    config = EngineConfig(progress=False, max_model_len=max(2048, plen + out), max_num_seqs=max(256, n))
    engine = LLMEngine(config, tokenizer=False)
    burst(engine, 8, plen, out, seed=0)  # warm: the ops' builds, oneDNN's primitives
    time.sleep(2)
    runs = []
    for i in range(args.runs):
        runs.append(burst(engine, n, plen, out, seed=i + 1))
        print(f"burst {i + 1}: {runs[-1][0]:.2f} s, {n * out / runs[-1][0]:.1f} output tok/s, "
              f"mean TTFT {runs[-1][1]:.2f} s", flush=True)  # fmt: skip
    host = measure_host()
    w = work(engine, n, plen, out)
    rate, read = host["onednn_flops"], host["read_Bps"]
    parts = {
        "products": w["products"] / rate,
        "prompt attention": w["prompt_attn"] / rate,
        "decode attention": max(w["decode_kv_bytes"] / read, w["decode_attn_flops"] / rate),
    }
    floor = sum(parts.values())
    achieved = statistics.median(r[0] for r in runs)
    share, ceiling = floor / achieved, n * out / floor
    print(f"\nhost: fp32 matmul {rate / 1e9:.0f} GFLOP/s (oneDNN, 2048^3), read {read / 1e9:.1f} GB/s; "
          f"{torch.get_num_threads()} threads")  # fmt: skip
    print("| part | work | floor s |\n|---|---|---|")
    print(f"| products | {w['products'] / 1e12:.3f} TFLOP | {parts['products']:.2f} |")
    print(f"| prompt attention | {w['prompt_attn'] / 1e12:.3f} TFLOP | {parts['prompt attention']:.2f} |")
    kv_gb = w["decode_kv_bytes"] / 1e9
    print(f"| decode attention | {kv_gb:.1f} GB of KV | {parts['decode attention']:.2f} |")
    print(f"| the burst | | **{floor:.2f}** |")
    print(f"achieved (median of {len(runs)}): {achieved:.2f} s, {n * out / achieved:.1f} output tok/s: "
          f"{share:.0%} of the floor; the floor's ceiling {ceiling:.1f} tok/s")  # fmt: skip
    if args.vllm:
        goal = args.goal * args.vllm
        need = n * out / goal
        print(f"{args.goal:g}x vLLM's {args.vllm:g} tok/s = {goal:.1f} tok/s: a {need:.2f} s burst, "
              f"{floor / need:.0%} of the floor (achieved now: {share:.0%})")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
