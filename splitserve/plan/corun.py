"""The co-run factor of a pinned profile (`StepCost.corun_factor`): how much slower a decode step
runs while another worker decodes on other cores of the host.

Workers pinned to cores of their own (core/pinning.py) share no compute, but they still share the
memory bus and the last-level cache. A decode step streams every weight once for a handful of rows,
so it is bound by memory bandwidth, and two of them at once slow each other; a prompt step is bound
by compute and is not slowed (docs/plan.md has the measurements on this repository's 2-core host).

`measure_corun` times decode steps of the profiling engine beside a neighbour process (`python -m
splitserve.plan.corun`: the same engine, pinned to another CPU, decoding a batch in a loop until its
stdin closes), paused and running in turn, and returns the ratio of the medians.
"""

from __future__ import annotations

import dataclasses
import json
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from typing import Any

NEIGHBOUR_BATCH = (4, 256)  # (requests, prompt tokens) the neighbour decodes
TIMED_BATCH = (4, 256)  # the profiling engine's decode batch, timed alone and beside it
ROUNDS, ROUND_STEPS = 4, 8  # alternations of (neighbour paused, neighbour decoding), steps timed in each


def random_prompts(n: int, length: int, vocab: int, seed: int) -> list[list[int]]:
    """`n` prompts of `length` random token ids (no prefix-cache hits), the same for a seed."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab, (n, length), generator=gen).tolist()


def drain(engine: Any, ids: list[str]) -> None:
    """Abort `ids` and step until the engine is empty."""
    for rid in ids:
        engine.abort(rid)
    while engine.has_unfinished_requests():
        engine.step()


def _step_times(engine, steps: int) -> list[float]:  # noqa: ANN001
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return times


def measure_corun(engine, config, cpus: Sequence[int], log=print) -> float:  # noqa: ANN001
    """The factor for `engine` (built from the EngineConfig `config`), the neighbour pinned to `cpus`.
    The neighbour is paused (SIGSTOP) and resumed in turn, so that the steps alone and beside it
    alternate and a drift in the host's speed meets both."""
    from splitserve.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True, detokenize=False)
    ids = [
        engine.add_request(p, params) for p in random_prompts(*TIMED_BATCH, engine.model_config.vocab_size, 7)
    ]
    _step_times(engine, 3)  # the prompts' step(s) and the first decode step
    spec = json.dumps({"config": dataclasses.asdict(config), "cpus": list(cpus)})
    argv = [sys.executable, "-m", "splitserve.plan.corun"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    alone: list[float] = []
    beside: list[float] = []
    try:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(spec + "\n")
        proc.stdin.flush()
        if proc.stdout.readline().strip() != "decoding":
            raise RuntimeError("the co-run neighbour did not start")
        for _ in range(ROUNDS):
            proc.send_signal(signal.SIGSTOP)
            alone += _step_times(engine, ROUND_STEPS)
            proc.send_signal(signal.SIGCONT)
            time.sleep(0.1)  # its step under way again
            beside += _step_times(engine, ROUND_STEPS)
    finally:
        drain(engine, ids)
        _stop(proc)
    a, b = statistics.median(alone) * 1e3, statistics.median(beside) * 1e3
    log(f"  co-run: a decode step {a:.1f} ms alone, {b:.1f} ms beside a decoding neighbour")
    return max(1.0, b / a)


def _stop(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGCONT)
    if proc.stdin is not None:
        proc.stdin.close()  # the neighbour stops at its next step
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _neighbour() -> int:
    """Read {config, cpus} from stdin, pin, build the engine, decode a batch until stdin closes."""
    import threading

    import torch

    from splitserve.config.engine import EngineConfig
    from splitserve.core.pinning import pin
    from splitserve.engine.engine import LLMEngine
    from splitserve.sampling.params import SamplingParams

    spec = json.loads(sys.stdin.readline())
    pin(spec["cpus"])
    torch.set_num_threads(len(spec["cpus"]))
    engine = LLMEngine(EngineConfig(**spec["config"]), tokenizer=False)
    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True, detokenize=False)
    for p in random_prompts(*NEIGHBOUR_BATCH, engine.model_config.vocab_size, 11):
        engine.add_request(p, params)
    engine.step()  # the prompts: the neighbour decodes from here on
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("decoding", flush=True)
    while not stop.is_set():
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(_neighbour())
