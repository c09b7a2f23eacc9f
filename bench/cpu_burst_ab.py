"""One CPU engine switch on and off, on the endpoint's rate-inf load replayed in one engine.

Each run is a fresh process that builds the default model's engine (SmolLM2-135M, fp32, as a served
worker builds it), warms it with 8 requests, then adds `--prompts` random prompts of `--prompt-len`
at once (what `vllm bench serve --request-rate inf` sends), sampled at temperature 1 with
`--output-len` tokens each, and steps the engine until all are done. It prints the run's wall time,
output tok/s, mean time to first token (without HTTP) and the minor page faults of the burst.

The runs alternate between the switch's two values (`--on`, `--off`), `--runs` of each, so that a
noisy neighbour on a shared host weighs on both alike; the medians and their ratio close the table.

    python bench/cpu_burst_ab.py SPLITSERVE_CPU_KEEP_HEAP          # malloc keeps freed memory or not
    python bench/cpu_burst_ab.py SPLITSERVE_CPU_PREFILL_ATTN --runs 3
    python bench/cpu_burst_ab.py SPLITSERVE_CPU_FUSED --prompts 16  # the fused ops and the sampler op
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_RUN = r"""
import json, resource, sys, time, torch
sys.path.insert(0, sys.argv[1])
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.sampling.params import SamplingParams
prompts, plen, out_len, budget = (int(a) for a in sys.argv[2:6])
config = EngineConfig(progress=False, kv_cache_bytes=2 << 30, max_model_len=2048, max_num_seqs=256,
                      max_num_batched_tokens=budget)
engine = LLMEngine(config, tokenizer=False)
gen = torch.Generator().manual_seed(0)
params = SamplingParams(temperature=1.0, max_tokens=out_len, ignore_eos=True, detokenize=False)
for q in torch.randint(0, 49152, (8, plen), generator=gen).tolist():
    engine.add_request(q, params)
while engine.has_unfinished_requests():
    engine.step()
time.sleep(2)  # the ops' background builds, where a first start needs them, have had their start
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
t0 = time.perf_counter()
for q in torch.randint(0, 49152, (prompts, plen), generator=gen).tolist():
    engine.add_request(q, params)
first = {}
while engine.has_unfinished_requests():
    for o in engine.step():
        first.setdefault(o.request_id, time.perf_counter() - t0)
total = time.perf_counter() - t0
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - faults
print(json.dumps({"total": total, "tok_s": prompts * out_len / total,
                  "ttft": sum(first.values()) / len(first), "faults": faults}))
"""


def run(switch: str, value: str, args: argparse.Namespace) -> dict:
    env = {**os.environ, switch: value}
    cmd = [sys.executable, "-c", _RUN, str(ROOT), str(args.prompts), str(args.prompt_len),
           str(args.output_len), str(args.budget)]  # fmt: skip
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("switch", help="an environment variable the engine reads, e.g. SPLITSERVE_CPU_KEEP_HEAP")
    ap.add_argument("--on", default="1")
    ap.add_argument("--off", default="0")
    ap.add_argument("--runs", type=int, default=2, help="runs of each value, alternating")
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=64)
    ap.add_argument("--budget", type=int, default=1024, help="max_num_batched_tokens (the CPU default)")
    args = ap.parse_args()
    print(f"{args.prompts} prompts of {args.prompt_len} at once, {args.output_len} tokens each, "
          f"budget {args.budget}; {os.cpu_count()} CPUs")  # fmt: skip
    print(f"| {args.switch} | wall s | output tok/s | mean TTFT s | minor faults |")
    print("|---|---|---|---|---|")
    results: dict[str, list[dict]] = {args.on: [], args.off: []}
    for _ in range(args.runs):
        for value in (args.on, args.off):
            r = run(args.switch, value, args)
            results[value].append(r)
            print(
                f"| {value} | {r['total']:.2f} | {r['tok_s']:.1f} | {r['ttft']:.2f} | {r['faults']} |",
                flush=True,
            )
    med = {
        v: {k: statistics.median(r[k] for r in rs) for k in ("tok_s", "ttft")} for v, rs in results.items()
    }
    on, off = med[args.on], med[args.off]
    print(f"median output tok/s: {on['tok_s']:.1f} ({args.on}) against {off['tok_s']:.1f} ({args.off}): "
          f"{on['tok_s'] / off['tok_s']:.3f}x; mean TTFT {on['ttft']:.2f} s against {off['ttft']:.2f} s "
          f"({on['ttft'] / off['ttft']:.3f}x)")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
