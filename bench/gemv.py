"""One token's linear layers at Qwen3-8B shape: cuBLAS (F.linear) against kernels/gemv.py, beside the
copy bandwidth measured in the same run.

Batch-1 decode reads every weight once a step, so each layer's time is its weight bytes over the
bandwidth it reaches. For each projection (fused QKV, o_proj, fused gate/up, down_proj, LM head) this
times F.linear and the GEMV over a sweep of its tile shapes (--quick: those `gemv.tiles` picks), replayed
from CUDA graphs and cycling through enough copies of the weight that none is served from L2, and
prints GB/s, the share of the copy bandwidth, and what a whole step's projections would take with
cuBLAS alone and with the GEMV where it is used (36 layers + the LM head).

    python bench/gemv.py            # one GPU, about a minute
    python bench/gemv.py --fused    # the batch-1 fusions: each fused GEMV against GEMV + its kernel
    python bench/gemv.py --fused --shape qwen3.5-9b --sweep small   # Qwen3.5-9B's projections

`--fused` times the variants model/decoder.py's batch-1 forward uses (kernels/gemv.py): QKV and
gate/up reading RMSNorm(residual) in factored form, o_proj adding into the residual in its epilogue,
down_proj both (SiLU-and-multiply in, residual out); each against the plain GEMV plus the separate
kernel it replaces (rmsnorm with its residual add, silu_mul), over a sweep of tile shapes.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.kernels import gemv as G  # noqa: E402

HIDDEN, INTER, LAYERS, VOCAB = 4096, 12288, 36, 151936
SHAPES = {  # name: (N outputs, K inputs, times per step)
    "qkv_proj": (4096 + 2 * 1024, HIDDEN, LAYERS),
    "o_proj": (HIDDEN, HIDDEN, LAYERS),
    "gate_up_proj": (2 * INTER, HIDDEN, LAYERS),
    "down_proj": (HIDDEN, INTER, LAYERS),
    "lm_head": (VOCAB, HIDDEN, 1),
}
SWEEP = list(
    itertools.product((4, 8, 16), (256, 512, 1024), (4, 8), (3, 4))
)  # BLOCK_N, BLOCK_K, warps, stages
# Qwen3.5-9B (24 Gated DeltaNet + 8 attention layers): the projections a batch-1 step reads
SHAPES_9B = {
    "in_proj": (12352, HIDDEN, 24),  # q, k, v | z | b | a of a DeltaNet layer
    "qkv_proj": (10240, HIDDEN, 8),  # per head [q | gate], then k, v
    "o_proj": (HIDDEN, HIDDEN, 32),  # out_proj and o_proj
    "gate_up_proj": (2 * INTER, HIDDEN, 32),
    "down_proj": (HIDDEN, INTER, 32),
    "lm_head": (248320, HIDDEN, 1),
}
FUSED_9B = {"in_proj": "normed", "qkv_proj": "normed", "o_proj": "residual", "gate_up_proj": "normed",
            "down_proj": "silu"}  # fmt: skip


def copy_bandwidth(nbytes: int = 4 << 30, iters: int = 10) -> float:
    """Bytes read + written per second by a large device-to-device copy."""
    a = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    b.copy_(a)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        b.copy_(a)
    end.record()
    end.synchronize()
    return 2 * nbytes * iters / (start.elapsed_time(end) / 1e3)


def timed(fn, weights: list[torch.Tensor], x: torch.Tensor, iters: int = 48) -> float:  # noqa: ANN001
    """Seconds per call, each call on the next weight copy (so none sits in L2), the calls replayed
    from one CUDA graph as the engine's decode graphs replay them (a Python loop of launches would
    time the host: a 4,096 x 4,096 layer reads in 8 us)."""
    for w in weights[:2]:
        fn(x, w)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=torch.cuda.Stream()):
        for i in range(iters):
            fn(x, weights[i % len(weights)])
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(3):
        graph.replay()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / (3 * iters)


def main() -> None:  # noqa: PLR0915
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="only the tiles the engine picks (gemv.tiles)")
    p.add_argument("--json", help="where to write the results (default: $OUT or bench/results)")
    p.add_argument("--fused", action="store_true", help="the batch-1 fused variants (see above)")
    p.add_argument("--shape", choices=("qwen3-8b", "qwen3.5-9b"), default="qwen3-8b")
    p.add_argument("--sweep", choices=("full", "small"), default="full", help="--fused: small = 12 tiles")
    args = p.parse_args()
    if args.shape == "qwen3.5-9b":
        SHAPES.clear()
        SHAPES.update(SHAPES_9B)
        FUSED.clear()
        FUSED.update(FUSED_9B)
    if args.sweep == "small":
        FUSED_SWEEP[:] = list(itertools.product((2, 4, 8), (512, 1024), (4, 8), (4,)))
    if args.fused:
        return fused(args.quick)
    torch.manual_seed(0)
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    rows, step_cublas, step_best = [], 0.0, 0.0
    for name, (n, k, per_step) in SHAPES.items():
        nbytes = n * k * 2
        copies = max(2, -(-(400 << 20) // nbytes))  # > 400 MiB in all: well past the 50 MiB L2
        weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) for _ in range(copies)]
        x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
        ref = F.linear(x, weights[0]).float()
        t_cublas = timed(lambda x, w: F.linear(x, w), weights, x)
        best, t_default = None, None
        default = G.tiles(n, k)  # what the engine uses for this shape
        for bn, bk, warps, stages in [default] if args.quick else SWEEP:

            def run(x, w, bn=bn, bk=bk, warps=warps, stages=stages):  # noqa: ANN001, ANN202
                return G.gemv(x, w, block_n=bn, block_k=bk, num_warps=warps, num_stages=stages)

            try:
                err = (run(x, weights[0]).float() - ref).abs().max().item()
                t = timed(run, weights, x)
            except Exception as exc:  # noqa: BLE001 - a tile shape this GPU cannot run
                print(f"  {name} {bn}x{bk} w{warps} s{stages}: {type(exc).__name__}", flush=True)
                continue
            if (bn, bk, warps, stages) == default:
                t_default = t
            if best is None or t < best[0]:
                best = (t, (bn, bk, warps, stages), err)
        assert best is not None
        t_best, config, err = best
        row = {"layer": name, "N": n, "K": k, "bytes": nbytes, "cublas_GBps": nbytes / t_cublas / 1e9,
               "gemv_GBps": nbytes / t_best / 1e9, "gemv_config": config, "gemv_max_abs_diff": err,
               "cublas_of_copy": nbytes / t_cublas / bw, "gemv_of_copy": nbytes / t_best / bw,
               "takes_gemv": n <= G.GEMV_MAX_N,
               "gemv_picked_GBps": nbytes / t_default / 1e9 if t_default else None}  # fmt: skip
        rows.append(row)
        step_cublas += per_step * t_cublas
        step_best += per_step * (t_best if row["takes_gemv"] else t_cublas)
        used = "GEMV" if row["takes_gemv"] else "cuBLAS"
        print(f"  {name:13} [{n:6} x {k:5}] cuBLAS {row['cublas_GBps']:6.0f} GB/s "
              f"({row['cublas_of_copy']:4.0%}), GEMV {row['gemv_GBps']:6.0f} GB/s "
              f"({row['gemv_of_copy']:4.0%}) with {config}, {t_cublas / t_best:.2f}x; "
              f"max |diff| {err:.3g}; picked tiles {row['gemv_picked_GBps'] or 0:.0f} GB/s; used: {used}",
              flush=True)  # fmt: skip
        del weights
        torch.cuda.empty_cache()
    weight_bytes = sum(n * k * 2 * per for n, k, per in SHAPES.values())
    floor = weight_bytes / bw
    print(f"a step's projections ({weight_bytes / 1e9:.2f} GB): cuBLAS alone {step_cublas * 1e3:.2f} ms "
          f"({floor / step_cublas:.0%} of the {floor * 1e3:.2f} ms floor), with the GEMV where it is used "
          f"{step_best * 1e3:.2f} ms ({floor / step_best:.0%}): {step_cublas / step_best:.2f}x")  # fmt: skip
    out_dir = Path(os.environ["OUT"]) if os.environ.get("OUT") else Path(__file__).parent / "results"
    path = Path(args.json) if args.json else out_dir / "gemv.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"copy_GBps": bw / 1e9, "rows": rows, "step_cublas_s": step_cublas,
                                "step_with_gemv_s": step_best}, indent=2))  # fmt: skip
    print(f"wrote {path}")


FUSED = {"qkv_proj": "normed", "o_proj": "residual", "gate_up_proj": "normed", "down_proj": "silu"}
FUSED_SWEEP = list(itertools.product((4, 8, 16, 32), (256, 512, 1024), (4, 8), (3, 4)))


def fused(quick: bool) -> None:
    """Per layer: GEMV + the kernel its fusion replaces, against the fused GEMV (best tile, and the
    tile `gemv.tiles` picks); then what a step saves (36 layers)."""
    bw = copy_bandwidth()
    print(f"{torch.cuda.get_device_name()}: copy bandwidth {bw / 1e9:.0f} GB/s (read + written)", flush=True)
    saved = sum(fused_layer(name, kind, quick, bw) for name, kind in FUSED.items())
    print(f"a step at the picked tiles saves {saved * 1e3:.3f} ms (each layer kind times its count a step)")


def fused_layer(name: str, kind: str, quick: bool, bw: float) -> float:
    """Times one layer's fused variant against GEMV + separate kernel; -> seconds a step saves."""
    from splitserve.kernels.fused import rmsnorm, silu_mul

    n, k, per_step = SHAPES[name]
    copies = max(2, -(-(400 << 20) // (n * k * 2)))
    weights = [torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64 for _ in range(copies)]
    res = torch.randn(1, HIDDEN, device="cuda", dtype=torch.bfloat16)
    norm_w = torch.rand(HIDDEN, device="cuda", dtype=torch.bfloat16) + 0.5
    # the factored norm o_proj/down_proj's epilogue writes: w * residual, and sums of squares per tile
    normed = G.NormedRow(res, res * norm_w, res.float().pow(2).reshape(512, -1).sum(1), norm_w, 1e-6, False)
    # x: normed: the mixer's (or MLP's) output, which the separate rmsnorm adds in; silu: [gate | up]
    x = torch.randn(1, 2 * k if kind == "silu" else k, device="cuda", dtype=torch.bfloat16)

    def separate(x, w):  # noqa: ANN001, ANN202
        if kind == "normed":
            return G.gemv(rmsnorm(x, norm_w, 1e-6, res), w)
        return G.gemv(silu_mul(x) if kind == "silu" else x, w)

    def variant(x, w, tile):  # noqa: ANN001, ANN202
        if kind == "normed":
            return G.gemv_normed(normed, w, tile=tile)
        return G.gemv_into_residual(x, w, None, res, norm_w, 1e-6, silu=kind == "silu", tile=tile)

    t_sep = timed(separate, weights, x)
    picked = G.tiles(n, k, kind)
    results = {}
    for tile in [picked] if quick else FUSED_SWEEP:
        try:
            results[tile] = timed(lambda x, w, tile=tile: variant(x, w, tile), weights, x)
        except Exception as exc:  # noqa: BLE001 - a tile shape this GPU cannot run
            print(f"  {name} {tile}: {type(exc).__name__}", flush=True)
    best = min(results, key=results.__getitem__)
    share = n * k * 2 / results[best] / bw
    print(f"  {name:13} {kind:8} GEMV + its kernel {t_sep * 1e6:6.2f} us; fused {results[best] * 1e6:6.2f} "
          f"us ({share:4.0%} of copy) with {best}, picked {picked} "
          f"{results.get(picked, float('nan')) * 1e6:6.2f} us", flush=True)  # fmt: skip
    del weights
    torch.cuda.empty_cache()
    return per_step * (t_sep - results.get(picked, results[best]))


if __name__ == "__main__":
    main()
