"""Where a constrained step's mask time goes, at a real vocabulary: xgrammar's batch fill on the host
(its threads), the AND of the JSON control-byte ban, the pinned host-to-device copy, and the apply
kernel (kernels/bitmask.py) against the torch unpack it replaced. Rows are matchers of the
bench/structured_outputs.py schema, advanced by a few tokens of a valid answer.

    python bench/grammar_mask.py --tokenizer TOKDIR --vocab 151936 --rows 32     # CUDA
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a bare checkout, too

from bench.structured_outputs import SCHEMA  # noqa: E402
from splitserve.engine.grammar import Grammars, _and_allowed, _batch_matcher  # noqa: E402
from splitserve.kernels.bitmask import apply_bitmask_  # noqa: E402
from splitserve.model.tokenizer import load_tokenizer  # noqa: E402
from splitserve.sampling.params import GrammarSpec  # noqa: E402


def _ms(fn, reps: int) -> float:
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1000)
    return statistics.median(times)


def _gpu_ms(fn, reps: int) -> float:
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    fn()
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--rows", type=int, default=32)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args()
    tok = load_tokenizer("random:qwen3-8b", args.tokenizer)
    grammars = Grammars(tok.hf, args.vocab, tok.eos_token_ids)
    spec = GrammarSpec("json", json.dumps(SCHEMA))
    compiled = grammars.compile(spec).result()
    words = -(-args.vocab // 32)
    one = torch.empty((1, words), dtype=torch.int32)
    matchers = []
    for i in range(args.rows):  # each advanced by a few allowed tokens (the lowest id allowed each time)
        m = grammars.matcher(spec, compiled)
        for _ in range(3 + i % 13):
            _batch_matcher().batch_fill_next_token_bitmask([m.matcher], one)
            _and_allowed(one, [(0, m)])
            bits = ((one[0, :, None] >> torch.arange(32, dtype=torch.int32)) & 1).reshape(-1)
            assert m.accept(int(bits.nonzero()[0]))
        matchers.append(m)
    host = torch.empty((args.rows, words), dtype=torch.int32, pin_memory=torch.cuda.is_available())
    batch = _batch_matcher()
    raw = [m.matcher for m in matchers]
    fill = _ms(lambda: batch.batch_fill_next_token_bitmask(raw, host), args.reps)
    ban = _ms(lambda: _and_allowed(host, list(enumerate(matchers))), args.reps)
    print(f"{args.rows} rows, vocab {args.vocab}: batch fill {fill:.3f} ms, control-byte AND {ban:.3f} ms")
    if not torch.cuda.is_available():
        return 0
    logits = torch.randn(args.rows, args.vocab, device="cuda")
    dev = host.to("cuda")
    copy = _gpu_ms(lambda: dev.copy_(host, non_blocking=True), args.reps)
    kernel = _gpu_ms(lambda: apply_bitmask_(logits, dev), args.reps)
    bits = torch.arange(32, dtype=torch.int32, device="cuda")

    def unpack() -> None:
        banned = ((dev[:, :, None] >> bits) & 1 == 0).reshape(args.rows, -1)[:, : args.vocab]
        logits.masked_fill_(banned, float("-inf"))

    torch_ms = _gpu_ms(unpack, args.reps)
    print(f"device: copy {copy:.3f} ms, apply kernel {kernel:.3f} ms (torch unpack {torch_ms:.3f} ms)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
