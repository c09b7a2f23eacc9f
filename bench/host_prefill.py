"""The host's own work for one long prompt's first token, part by part, outside the model's forward.

A tiny random Qwen3.5 hybrid engine on the CPU, its forward replaced by a stub that only builds the
Gated DeltaNet varlen metadata (model/gdn_prefill.py's `build_linear_prefill`, which the CUDA path
builds once a step) and returns zeros, and logits of the 9B's vocabulary (248,320 columns): what is
left of `add_request` + `step()` is the host's time that a GPU waits on. Median over `--repeats`
prompts of fresh random tokens (the prefix cache misses), in microseconds:

    add_request   prompt ids checked against the vocabulary, the Request built
    schedule      prefix lookup (the prompt's block hash chain), blocks and a state slot allocated
    prepare       the flat step inputs and the attention metadata (engine/runner.py)
    linear meta   the varlen linear-attention chunk table (build_linear_prefill)
    sample        the sampler over the logits
    update        tokens appended, full blocks cached under their hashes, the request finished
    outputs       the step's RequestOutputs

Baseline in the same run: the prompt's hash chain computed block by block (`hash_block` per block,
as the engine did before `extend_chain`) against `extend_chain`, and the ratio.

    python bench/host_prefill.py                     # 4,096 tokens, 30 repeats
    python bench/host_prefill.py --prompt-len 1088 --repeats 100
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from splitserve.config.engine import EngineConfig  # noqa: E402
from splitserve.engine.engine import LLMEngine  # noqa: E402
from splitserve.model.gdn_prefill import build_linear_prefill  # noqa: E402
from splitserve.model.random_weights import random_model, random_model_config  # noqa: E402
from splitserve.sampling.params import SamplingParams  # noqa: E402
from splitserve.wire.kv_events import ROOT_HASH, extend_chain, hash_block  # noqa: E402

VOCAB_9B = 248320
PARTS = ("add_request", "schedule", "prepare", "linear meta", "sample", "update", "outputs")


class StubModel(torch.nn.Module):
    """The model's place in the step: builds the step's linear-attention metadata, returns zeros."""

    def __init__(self, model: torch.nn.Module, times: dict[str, list[float]]) -> None:
        super().__init__()
        self.cfg, self.times = model.cfg, times

    def forward(self, ids: torch.Tensor, positions: torch.Tensor, ctx) -> torch.Tensor:  # noqa: ANN001
        t0 = time.perf_counter()
        build_linear_prefill(ctx.meta, ids.device)
        self.times["linear meta"].append(time.perf_counter() - t0)
        return torch.zeros(ids.shape[0], self.cfg.hidden_size)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return torch.zeros(hidden.shape[0], VOCAB_9B)


def timed(fn: Callable, name: str, times: dict[str, list[float]]) -> Callable:
    def wrapper(*args: object, **kwargs: object) -> object:
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        times[name].append(time.perf_counter() - t0)
        return out

    return wrapper


def build(prompt_len: int, times: dict[str, list[float]]) -> LLMEngine:
    hf = random_model_config("qwen3.5-tiny-random")
    hf["max_position_embeddings"] = max_len = prompt_len + 64
    loaded = random_model(hf, "cpu", torch.float32, max_len)
    config = EngineConfig(model="random:qwen3.5-tiny", device="cpu", max_num_seqs=2, max_model_len=max_len,
                          max_num_batched_tokens=max_len, kv_cache_bytes=2**28, progress=False)  # fmt: skip
    engine = LLMEngine(config, tokenizer=False, loaded=loaded)
    engine.runner.model = StubModel(engine.runner.model, times)
    sched, runner = engine.scheduler, engine.runner
    sched.schedule = timed(sched.schedule, "schedule", times)
    sched.update_from_output = timed(sched.update_from_output, "update", times)
    runner.prepare = timed(runner.prepare, "prepare", times)
    engine.sampler = timed(engine.sampler, "sample", times)
    engine.table.outputs = timed(engine.table.outputs, "outputs", times)
    return engine


def chain_by_block(ids: list[int], block_size: int) -> list[bytes]:
    out, parent = [], ROOT_HASH
    for i in range(len(ids) // block_size):
        parent = hash_block(parent, ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def hashing(ids: list[int], block_size: int, repeats: int) -> tuple[float, float]:
    """Median seconds of the prompt's chain: block by block, and with `extend_chain`."""
    assert chain_by_block(ids, block_size) == extend_chain(ROOT_HASH, ids, block_size)
    runs: dict[str, list[float]] = defaultdict(list)
    for _ in range(repeats):
        for name, fn in (("by block", chain_by_block), ("chain", extend_chain)):
            args = (ids, block_size) if name == "by block" else (ROOT_HASH, ids, block_size)
            t0 = time.perf_counter()
            fn(*args)
            runs[name].append(time.perf_counter() - t0)
    return statistics.median(runs["by block"]), statistics.median(runs["chain"])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--prompt-len", type=int, default=4096)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args()
    torch.set_num_threads(1)
    times: dict[str, list[float]] = defaultdict(list)
    engine = build(args.prompt_len, times)
    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    gen = torch.Generator().manual_seed(0)
    for i in range(args.repeats + 3):
        if i == 3:
            times.clear()  # the first prompts warm up
        ids = torch.randint(0, engine.runner.model.cfg.vocab_size, (args.prompt_len,), generator=gen).tolist()
        t0 = time.perf_counter()
        engine.add_request(ids, params)
        times["add_request"].append(time.perf_counter() - t0)
        while engine.has_unfinished_requests():
            engine.step()
    med = {p: statistics.median(times[p]) * 1e6 for p in PARTS}
    print(f"host time of one {args.prompt_len}-token prompt's first token, outside the forward "
          f"(median of {args.repeats}, us):")  # fmt: skip
    for p in PARTS:
        print(f"  {p:12s} {med[p]:8.1f}")
    print(f"  {'total':12s} {sum(med.values()):8.1f}")
    bs = engine.scheduler.block_manager.block_size
    ref, new = hashing(ids, bs, args.repeats)
    print(f"hash chain of {len(ids) // bs} blocks: extend_chain {new * 1e6:.1f} us, block by block "
          f"(baseline) {ref * 1e6:.1f} us: {new / ref:.2f}x")  # fmt: skip


if __name__ == "__main__":
    main()
