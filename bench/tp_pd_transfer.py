"""Prefill and decode at different tensor-parallel sizes on the CPU: the bytes each rank serves and is
written, and the time of one request's KV import, against prefill 1 -> decode 1 in the same run.

Random weights at a named shape (default: random:qwen3.5-tiny, the hybrid: KV heads and Gated DeltaNet
state), fp32, over tcp. For each pair of sizes, R requests of L prompt tokens are prefilled and
exported by an engine at size P and imported by one at size D; the script prints, per pair: the
bytes each prefill rank served, the bytes written into each decode rank's pool (its own KV heads and
state channels only), the mean fetch seconds of a request (the decode connector's `fetch_seconds`
over its `fetches`), and its ratio against 1 -> 1 (the baseline). At P == D every decode rank
fetches its twin's part straight into its pool; otherwise each decode rank reads only its own heads
and state channels from each prefill rank holding them (one fetch per pair of ranks that share
heads): straight into its pool where a part fills whole rows of its blocks, else into one host buffer
placed by a strided copy per run of heads (transport/part_sink.py). Each prefill rank serves from its
own process, out of its own pool (engine/tp/rank_exports.py), and each decode rank reads in its own
(rank 0's orders go to the others: engine/tp/read_orders.py). Greedy tokens are compared
with the baseline (they must be equal). A shared 2-core host: no speed goal, the figure shows what the
extra fetches and servers cost.

    python bench/tp_pd_transfer.py
    python bench/tp_pd_transfer.py --model random:tiny-llama --requests 8 --prompt-len 200
"""

from __future__ import annotations

import argparse

import torch

from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.kv_connector import KVConnector
from splitserve.sampling.params import SamplingParams
from splitserve.transport import TransportOptions

PAIRS = [(1, 1), (1, 2), (2, 1), (2, 2)]


def engine(model: str, size: int) -> tuple[LLMEngine, KVConnector]:
    config = EngineConfig(model=model, tensor_parallel_size=size, dtype="float32", device="cpu",
                          max_model_len=1024, kv_cache_bytes=64 << 20, max_num_seqs=8,
                          progress=False)  # fmt: skip
    e = LLMEngine(config, tokenizer=False)
    return e, KVConnector.open(e, "tcp", secret="bench", options=TransportOptions(fetch_timeout_s=60))


def drain(e: LLMEngine) -> dict:
    done = {}
    while e.has_unfinished_requests():
        for out in e.step():
            if out.finished:
                done[out.request_id] = out
    return done


def run(model: str, p_size: int, d_size: int, prompts: list[list[int]]) -> dict:
    (p, pc), (d, dc) = engine(model, p_size), engine(model, d_size)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    try:
        for i, prompt in enumerate(prompts):
            p.add_request(prompt, params, request_id=f"p{i}", kv_transfer="export")
        exported = drain(p)
        for i, prompt in enumerate(prompts):
            out = exported[f"p{i}"]
            d.add_request_with_kv(out.kv_export.handle, prompt, out.outputs[0].token_ids[0], params, f"d{i}")
        done = drain(d)
        info = pc.transport.describe()
        tp = info.tensor_parallel
        served = tp.served_bytes if tp else [info.counts.get("served_bytes", 0)]
        serving = len(set(tp.served_pids)) if tp else 1  # processes that served the prefill ranks
        tp = dc.transport.describe().tensor_parallel
        written = tp.fetched_bytes if tp else [int(dc.counts["fetched_bytes"])]
        fetch_s = dc.counts["fetch_seconds"] / max(1, dc.counts["fetches"])
        tokens = [done[f"d{i}"].outputs[0].token_ids for i in range(len(prompts))]
        return {"served": served, "serving": serving, "written": written, "fetch_s": fetch_s,
                "tokens": tokens}  # fmt: skip
    finally:
        for e, c in ((p, pc), (d, dc)):
            c.close()
            if e.config.tensor_parallel_size > 1:
                e.runner.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="random:qwen3.5-tiny")
    ap.add_argument("--requests", type=int, default=4)
    ap.add_argument("--prompt-len", type=int, default=300)
    args = ap.parse_args()
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(3, 500, (args.prompt_len,), generator=gen).tolist() for _ in range(args.requests)
    ]
    base = None
    for p_size, d_size in PAIRS:
        r = run(args.model, p_size, d_size, prompts)
        base = base or r
        assert r["tokens"] == base["tokens"], f"{p_size} -> {d_size}: tokens differ from 1 -> 1"
        ratio = r["fetch_s"] / base["fetch_s"]
        print(f"prefill {p_size} -> decode {d_size}: served per prefill rank {r['served']} B (by "
              f"{r['serving']} processes), written per "
              f"decode rank {r['written']} B, fetch {r['fetch_s'] * 1e3:.2f} ms a request "
              f"(1 -> 1: {base['fetch_s'] * 1e3:.2f} ms, ratio {ratio:.2f})")  # fmt: skip


if __name__ == "__main__":
    main()
