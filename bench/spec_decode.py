"""Speculative decoding (prompt lookup, `ngram`) against plain decoding, measured in the same run.

The default model (SmolLM2-135M-Instruct, fp32 GGUF) on the CPU, greedy, two traces:

* quoting: a passage of the repository's own documents (docs/*.md) in the prompt and a question
  whose answer quotes it (retrieval-augmented generation / summarization);
* nothing to quote: open-ended requests whose prompts hold nothing to copy.

Each request runs alone (single stream), with and without drafts (one engine, its drafter detached
for the plain runs: the same weights and KV cache), alternating which goes first; the
script prints the median time per output token (TPOT) of each mode, the ratio, output tok/s, the
acceptance rate (accepted / proposed draft tokens) and the mean tokens a verify step produced, and
whether both modes gave the same tokens (greedy: they must). `--burst N` adds N nothing-to-quote
requests at once (rate inf), output tok/s with and without drafts (two runs each, alternating).

    python bench/spec_decode.py                               # k = 8, n-grams 2..5, 6 + 6 requests
    python bench/spec_decode.py --k 3 --max-tokens 96 --burst 16
"""

from __future__ import annotations

import argparse
import re
import statistics
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.sampling.params import SamplingParams

DOCS = Path(__file__).resolve().parent.parent / "docs"
QUESTION = "Which sentences of the passage explain what it is about? Answer by quoting them word for word."
OPEN_ENDED = [
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "Give me five ideas for a birthday party for a ten-year-old.",
    "Explain why the sky is blue to a child.",
    "Write a poem about autumn leaves.",
    "What are some good habits for staying healthy?",
    "Describe a day in the life of a honeybee.",
]


def passages(n: int, lo: int = 400, hi: int = 1200) -> list[str]:
    """`n` prose paragraphs of `lo`..`hi` characters from docs/*.md, spread over the documents."""
    found: list[str] = []
    for path in sorted(DOCS.glob("*.md")):
        text = re.sub(r"```.*?```", "", path.read_text(), flags=re.S)
        for para in re.split(r"\n\s*\n", text):
            para = " ".join(para.split())
            prose = not para.startswith(("#", "|", "-", "*", ">")) and para.count("`") < 8
            if prose and lo <= len(para) <= hi:
                found.append(para)
    step = max(1, len(found) // n)
    return found[::step][:n]


def prompt_ids(engine: LLMEngine, text: str) -> list[int]:
    assert engine.tokenizer is not None
    return engine.tokenizer.apply_chat_template([{"role": "user", "content": text}])


def single(engine: LLMEngine, ids: list[int], max_tokens: int) -> tuple[list[int], float, float]:
    """One request alone: -> (its tokens, TPOT in seconds, output tok/s from its first step)."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens)
    rid = engine.add_request(ids, params)
    t0 = time.perf_counter()
    times: list[float] = []
    tokens: list[int] = []
    while engine.has_request(rid) or engine.has_unfinished_requests():
        for out in engine.step():
            now = time.perf_counter()
            new = out.outputs[0].token_ids
            times += [now] * (len(new) - len(tokens))
            tokens = new
    tpot = (times[-1] - times[0]) / max(1, len(tokens) - 1)
    return tokens, tpot, len(tokens) / (times[-1] - t0)


def burst(engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> float:
    """All requests at once; -> output tok/s."""
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    for ids in prompts:
        engine.add_request(ids, params)
    t0, n = time.perf_counter(), 0
    while engine.has_unfinished_requests():
        n += sum(len(o.outputs[0].token_ids) for o in engine.step() if o.finished)
    return n / (time.perf_counter() - t0)


@contextmanager
def drafting(engine: LLMEngine, on: bool) -> Iterator[None]:
    """Inside: `engine` drafts (on) or decodes plainly (its drafter detached)."""
    spec = engine.spec
    engine.spec = spec if on else None
    try:
        yield
    finally:
        engine.spec = spec


def run_trace(name: str, engine: LLMEngine, prompts: list[list[int]], max_tokens: int) -> None:
    assert engine.spec is not None
    before = engine.spec.stats()
    rows: dict[str, list[tuple[float, float]]] = {"off": [], "ngram": []}
    same = 0
    for i, ids in enumerate(prompts):
        outs = {}
        for mode in ("off", "ngram") if i % 2 == 0 else ("ngram", "off"):
            with drafting(engine, mode == "ngram"):
                tokens, tpot, tps = single(engine, ids, max_tokens)
            rows[mode].append((tpot, tps))
            outs[mode] = tokens
        same += outs["off"] == outs["ngram"]
        print(f"  {name} #{i}: prompt {len(ids)} tok, output {len(outs['off'])} tok, TPOT off "
              f"{rows['off'][-1][0] * 1e3:.1f} ms, ngram {rows['ngram'][-1][0] * 1e3:.1f} ms")  # fmt: skip
    after = engine.spec.stats()
    drafted = after.num_draft_tokens - before.num_draft_tokens
    accepted = after.num_accepted_tokens - before.num_accepted_tokens
    runs = after.num_drafts - before.num_drafts
    tpot = {m: statistics.median(r[0] for r in v) for m, v in rows.items()}
    tps = {m: statistics.median(r[1] for r in v) for m, v in rows.items()}
    print(f"{name}: median TPOT off {tpot['off'] * 1e3:.1f} ms, ngram {tpot['ngram'] * 1e3:.1f} ms, "
          f"ratio (off / ngram) {tpot['off'] / tpot['ngram']:.2f}x; output tok/s off {tps['off']:.1f}, "
          f"ngram {tps['ngram']:.1f} ({tps['ngram'] / tps['off']:.2f}x); acceptance "
          f"{accepted / max(1, drafted):.0%} of {drafted} draft tokens in {runs} verify steps (mean "
          f"{1 + accepted / max(1, runs):.2f} tokens a step); same tokens {same}/{len(prompts)}")  # fmt: skip


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    ap.add_argument("--min-n", type=int, default=2, help="prompt_lookup_min")
    ap.add_argument("--max-n", type=int, default=5, help="prompt_lookup_max")
    ap.add_argument("--requests", type=int, default=6, help="requests of each trace")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--burst", type=int, default=0, help="nothing-to-quote requests at once (0: none)")
    args = ap.parse_args()
    spec_cfg = {"method": "ngram", "num_speculative_tokens": args.k, "prompt_lookup_min": args.min_n,
                "prompt_lookup_max": args.max_n}  # fmt: skip
    knobs = dict(device="cpu", progress=False, max_model_len=2048, kv_cache_bytes=256 << 20)
    engine = LLMEngine(EngineConfig(**knobs, speculative_config=spec_cfg))
    print(f"model {engine.model_path}, {torch.get_num_threads()} threads; speculative config {spec_cfg}")
    quoting = [prompt_ids(engine, f"{p}\n\n{QUESTION}") for p in passages(args.requests)]
    open_ended = [prompt_ids(engine, OPEN_ENDED[i % len(OPEN_ENDED)]) for i in range(args.requests)]
    single(engine, quoting[0], 16)  # warm-up: the CPU ops load
    run_trace("quoting", engine, quoting, args.max_tokens)
    run_trace("nothing to quote", engine, open_ended, args.max_tokens)
    if args.burst:
        prompts = [prompt_ids(engine, OPEN_ENDED[i % len(OPEN_ENDED)]) for i in range(args.burst)]
        runs: dict[bool, list[float]] = {False: [], True: []}
        for on in (False, True, True, False):  # alternating: the host's load drifts
            with drafting(engine, on):
                runs[on].append(burst(engine, prompts, args.max_tokens))
        off, on = statistics.median(runs[False]), statistics.median(runs[True])
        print(f"burst of {args.burst} (rate inf), nothing to quote: output tok/s off {off:.1f}, ngram "
              f"{on:.1f} ({on / off:.2f}x)")  # fmt: skip


if __name__ == "__main__":
    main()
