"""The CPU sampler's draw alone: inverse CDF (engine/sampler.py, one uniform number a row) against the
exponential race it replaced on CPU (one Exp(1) number per vocabulary entry), in the same run, and the
same inverse-CDF draw as one C++ op over the logits (kernels/cpu/fused.py `sample_rows`, what the engine
runs once the op is built), against the torch inverse CDF.

Rows of the default model's vocabulary (49,152) at temperature 1, no filters (what `vllm bench serve`
asks for when it names no temperature), softmax included in both; the median of `--iters` calls.
Also prints how far each draw's token frequencies are from the distribution over `--check` draws of
one 50-token distribution (both should be within sampling noise, ~1/sqrt(draws)).

    python bench/cpu_sampler.py
    python bench/cpu_sampler.py --rows 1 8 64 256 --iters 30
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.engine.sampler import _inverse_cdf  # noqa: E402
from splitserve.model import cpu_fused  # noqa: E402


def exponential_race(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    q = torch.empty_like(probs)
    for i in range(probs.shape[0]):  # per row, as the engine draws (a seeded request has its own generator)
        q[i].exponential_(generator=gen)
    return (probs / q).argmax(dim=-1)


def inverse_cdf(probs: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    return _inverse_cdf(probs, [gen] * probs.shape[0])


def _median_ms(fn, iters: int) -> float:
    fn()
    times = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return sorted(times)[len(times) // 2] * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--check", type=int, default=100_000, help="draws for the frequency check")
    args = ap.parse_args()
    gen = torch.Generator().manual_seed(0)
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads, vocabulary {args.vocab}")
    op = cpu_fused.load(force=True)
    print("| rows | exponential race (ms) | inverse CDF (ms) | ratio | op (ms) | inverse CDF / op |")
    print("|---|---|---|---|---|---|")
    for rows in args.rows:
        logits = torch.randn(rows, args.vocab, generator=gen) * 3
        race = _median_ms(lambda lg=logits: exponential_race(torch.softmax(lg, -1), gen), args.iters)
        icdf = _median_ms(lambda lg=logits: inverse_cdf(torch.softmax(lg, -1), gen), args.iters)
        if op:
            temps, u = torch.ones(rows), torch.rand(rows, generator=gen, dtype=torch.float64)
            fused = _median_ms(lambda lg=logits, t=temps, u=u: cpu_fused.sample_rows(lg, t, u), args.iters)
            tail = f" {fused:.2f} | {icdf / fused:.1f}x |"
        else:
            tail = " (not built) | |"
        print(f"| {rows} | {race:.2f} | {icdf:.2f} | {race / icdf:.1f}x |{tail}")
    probs = torch.softmax(torch.randn(1, 50, generator=gen) * 2, -1)
    batch = probs.expand(1000, 50).contiguous()
    for name, draw in (("exponential race", exponential_race), ("inverse CDF", inverse_cdf)):
        tokens = torch.cat([draw(batch, gen) for _ in range(args.check // 1000)])
        freq = torch.bincount(tokens, minlength=50).double() / tokens.numel()
        print(f"{name}: largest |frequency - p| over {tokens.numel()} draws: "
              f"{(freq - probs[0].double()).abs().max().item():.4f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
