"""The CPU paged decode op (kernels/cpu/attention.py) alone, against the gather + SDPA path it replaces.

One layer (another one each call, so that K/V come from memory) of the default model's shape (9 query
heads, 3 KV heads, head_dim 64, blocks of 16) over B sequences of `--context` tokens in scattered
blocks; prints the median of `--iters` calls for each path, alternating call by call, the ratio, and
the rate at which the op reads K and V (bytes of the cached rows / time) beside the host's read
bandwidth measured in the same run, and its share of it; and the op's build (or cache load) time.
`--avx2` (an AVX-512 host): also the op's AVX2 body (kernels/cpu/attention.py, the one before
kernels/cpu/attention_avx512.py), measured in a child process started by this run with
SPLITSERVE_CPU_ATTN_AVX512=0 (one process loads one build of the op), and the ratio.

    python bench/cpu_attention_op.py
    python bench/cpu_attention_op.py --batches 1 64 --context 1024
    python bench/cpu_attention_op.py --avx2 --batches 1 4 16 64 --iters 61
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.model import cpu_attention  # noqa: E402
from splitserve.model.attention import DecodeGroup, TorchPagedAttention  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 16, 64])
    ap.add_argument("--context", type=int, default=272)
    ap.add_argument("--iters", type=int, default=21)
    ap.add_argument("--avx2", action="store_true", help="also the AVX2 body, in a child process")
    ap.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # the child's answer
    args = ap.parse_args()
    avx2 = _avx2_body(args) if args.avx2 else {}
    h, kvh, d, bs, layers = 9, 3, 64, 16, 30
    t = time.perf_counter()
    op = cpu_attention.load(force=True)
    print(f"op build/load: {time.perf_counter() - t:.1f} s; flags {cpu_attention.LIB.flags}; "
          f"{torch.get_num_threads()} threads", flush=True)  # fmt: skip
    if op is None:
        print("the op could not be built here")
        return 1
    x = torch.ones(256 << 20)
    host = x.numel() * 4 / min(_time(torch.sum, x) for _ in range(5)) / 1e9
    print(f"host read bandwidth: {host:.1f} GB/s")
    del x
    nb_seq = -(-args.context // bs)
    scale = d**-0.5
    ref = TorchPagedAttention(scale)
    medians: dict[int, float] = {}
    head = "| batch | context | gather + SDPA ms | paged op ms | ratio | op reads K+V at (share of host) |"
    if avx2:
        head += " AVX2 body ms | op / AVX2 body |"
    if not args.json:
        print(head + "\n" + "|---" * (head.count("|") - 1) + "|")
    for b in args.batches:
        num_blocks = b * nb_seq + 8
        gen = torch.Generator().manual_seed(b)
        kv = torch.randn((num_blocks, layers, 2, bs, kvh, d), generator=gen)  # the engine's layout
        tables = torch.randperm(num_blocks, generator=gen)[: b * nb_seq].view(b, nb_seq)
        lens = torch.full((b,), args.context, dtype=torch.int64)
        q = torch.randn(b, h, d, generator=gen)
        kc, vc = kv[:, 7, 0], kv[:, 7, 1]
        group = DecodeGroup(0, b, tables, lens)
        torch.testing.assert_close(
            cpu_attention.paged_decode(q, kc, vc, tables, lens, scale),
            ref._decode(q, kc, vc, group),
            rtol=1e-5,
            atol=1e-6,
        )
        g_t, o_t = [], []
        for i in range(args.iters):  # alternating; each call on another layer's blocks (cold, as in a step)
            kc, vc = kv[:, i % layers, 0], kv[:, (i + layers // 2) % layers, 1]
            g_t.append(_time(ref._decode, q, kc, vc, group))
            kc, vc = kv[:, (i + 7) % layers, 0], kv[:, (i + 7 + layers // 2) % layers, 1]
            o_t.append(_time(cpu_attention.paged_decode, q, kc, vc, tables, lens, scale))
        g, o = statistics.median(g_t), statistics.median(o_t)
        medians[b] = o
        kv_bytes = 2 * b * args.context * kvh * d * 4
        rate = kv_bytes / o / 1e9
        row = f"| {b} | {args.context} | {g * 1e3:.2f} | {o * 1e3:.2f} | {g / o:.2f}x "
        row += f"| {rate:.1f} GB/s ({rate / host:.0%}) |"
        if b in avx2:
            row += f" {avx2[b] * 1e3:.2f} | {avx2[b] / o:.2f}x |"
        if not args.json:
            print(row)
    if args.json:
        print(json.dumps(medians))
    return 0


def _avx2_body(args: argparse.Namespace) -> dict[int, float]:
    """The op's median per batch with its AVX2 body, from this script in a child process."""
    cmd = [sys.executable, __file__, "--json", "--context", str(args.context), "--iters", str(args.iters)]
    env = {**os.environ, "SPLITSERVE_CPU_ATTN_AVX512": "0"}
    done = subprocess.run(
        [*cmd, "--batches", *map(str, args.batches)], env=env, capture_output=True, text=True
    )
    if done.returncode != 0:
        raise SystemExit(f"the AVX2 child failed: {done.stderr[-2000:]}")
    print("AVX2 body (child): " + done.stdout.splitlines()[0], flush=True)
    return {int(k): v for k, v in json.loads(done.stdout.splitlines()[-1]).items()}


def _time(fn, *args) -> float:  # noqa: ANN001, ANN002
    t = time.perf_counter()
    fn(*args)
    return time.perf_counter() - t


if __name__ == "__main__":
    raise SystemExit(main())
