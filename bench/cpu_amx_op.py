"""kernels/cpu/amx.py's products against the fp32 paths, on the embedded model's own weights.

For each projection shape of the default model (SmolLM2-135M, Q4_1; its LM head Q8_0) and each row
count, in the same process and alternating: oneDNN's fp32 matmul over the packed weight (the prompt
path), the decode panels (kernels/cpu/gemm.py, up to its 128 rows) and the AMX block op, each as GFLOP/s
of fp32 work with its largest error against an fp64 product (relative to the largest output). Then the
host's limits measured in the same run: oneDNN's fp32 rate at 2048^3 (the FMA rate the fp32 paths
are held to) and oneDNN's bf16 rate at 2048^3 (the AMX tiles' rate; the op does three bf16 products a
block, so a third of it, in fp32 work, is its ceiling).

    python bench/cpu_amx_op.py
    python bench/cpu_amx_op.py --rows 16 32 64 1024 --reps 5
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.kernels.cpu import amx as cpu_amx
from splitserve.kernels.cpu import gemm as cpu_gemm
from splitserve.model import cpu_linear  # noqa: E402
from splitserve.model.loader import load_model, resolve_model_path  # noqa: E402


def _time(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return (time.perf_counter() - t) / reps


def _rate(a: torch.Tensor, b: torch.Tensor, reps: int) -> float:
    packed = cpu_linear.pack(b)
    return (
        2
        * a.shape[0]
        * b.shape[0]
        * a.shape[1]
        / min(_time(lambda: cpu_linear.packed_linear(a, packed, None), reps) for _ in range(2))
    )


def row(name: str, w: torch.Tensor, x: torch.Tensor, layouts: tuple, reps: int) -> str:
    """One table row: each path's GFLOP/s (error against fp64) over x @ w.T, alternating."""
    packed, panels, blocks = layouts
    (n, k), rows = w.shape, x.shape[0]
    ref = x.double() @ w.double().t()
    fns = {
        "onednn": lambda: cpu_linear.packed_linear(x, packed, None),
        "amx": lambda: cpu_amx.matmul(x, blocks, None),
    }
    if rows <= cpu_gemm.MAX_ROWS:
        fns["panels"] = lambda: cpu_gemm.matmul(x, panels, n, None)
    reps = max(reps, int(1e9 / (2 * rows * n * k)))
    best: dict[str, float] = {}
    for _ in range(2):  # alternating
        for key, fn in fns.items():
            best[key] = min(best.get(key, float("inf")), _time(fn, reps))
    cell = {}
    for key, fn in fns.items():
        err = float((fn().double() - ref).abs().max() / ref.abs().max())
        cell[key] = f"{2 * rows * n * k / best[key] / 1e9:.0f} ({err:.1e})"
    fp32 = min(best["onednn"], best.get("panels", float("inf")))
    cells = [name, f"{n} x {k}", str(rows), cell["onednn"], cell.get("panels", ""), cell["amx"]]
    return "| " + " | ".join(cells) + f" | {fp32 / best['amx']:.2f}x |"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", type=int, nargs="+", default=[16, 32, 64, 128, 1024])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    if not cpu_amx.supported():
        print("this host has no AMX-BF16: the op does not run here")
        return 0
    if not (cpu_amx.load(force=True) and cpu_gemm.load(force=True)):
        print("the AMX op or the panels' op did not build here")
        return 1
    loaded = load_model(
        resolve_model_path(None), torch.device("cpu"), torch.float32, lambda c: 2048, progress=False
    )
    model = loaded.model
    attn, mlp = model.layers[0].self_attn, model.layers[0].mlp
    weights = {"qkv": attn.qkv_proj.weight, "o": attn.o_proj.weight, "gate/up": mlp.gate_up_proj.weight,
               "down": mlp.down_proj.weight, "lm_head": model.embed_tokens.weight}  # fmt: skip
    print(f"torch {torch.__version__}, {torch.get_num_threads()} threads")
    print("| weight | N x K | rows | oneDNN fp32 | panels | AMX op | AMX / best fp32 |")
    print("|---|---|---|---|---|---|---|")
    gen = torch.Generator().manual_seed(0)
    for name, w in weights.items():
        w = w.detach().float().contiguous()
        n, k = w.shape
        packed, panels, blocks = cpu_linear.pack(w), cpu_gemm.pack(w), cpu_amx.blocks(w)
        assert blocks is not None, f"{name}: not block-quantized"
        for rows in args.rows:
            x = torch.randn(rows, k, generator=gen)
            print(row(name, w, x, (packed, panels, blocks), args.reps))
    a = torch.randn(2048, 2048, generator=gen)
    b = torch.randn(2048, 2048, generator=gen)
    fp32 = _rate(a, b, 5)
    bf16 = _rate(a.bfloat16(), b.bfloat16(), 5)
    print(f"\nhost: oneDNN fp32 {fp32 / 1e9:.0f} GFLOP/s, bf16 {bf16 / 1e9:.0f} GFLOP/s at 2048^3;")
    ceiling = bf16 / 3
    print(f"the op's ceiling (three bf16 products): {ceiling / 1e9:.0f} GFLOP/s of fp32 work", end="")
    print(f", {ceiling / fp32:.2f}x fp32")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
