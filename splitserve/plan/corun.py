"""The co-run factors of a pinned profile (`StepCost.corun_factor` and its kin): how much slower a
step runs while another worker of the host runs one of its own on other cores.

Workers pinned to cores of their own (core/pinning.py) share no compute, but they still share the
memory bus and the last-level cache. A decode step streams every weight once for a handful of rows,
so it is bound by memory bandwidth, and two of them at once slow each other; a prompt step reuses
each weight over many rows, yet it too loses some speed beside a neighbour that streams weights
(docs/plan.md has the measurements on this repository's 2-core host). Four pairings, each a factor:

    decode beside decode    corun_factor
    prompt beside decode    corun_prefill_factor
    decode beside prompt    corun_decode_prefill_factor
    prompt beside prompt    corun_prefill_prefill_factor

`measure_corun` times decode steps and prompt steps of the profiling engine beside a neighbour
process (`python -m splitserve.plan.corun`: the same engine, pinned to another CPU, decoding a batch
or prefilling prompts in a loop until its stdin closes), paused and running in turn, so that a drift
of the host's speed meets both sides; each factor is the ratio of the medians.
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
NEIGHBOUR_PROMPT = 256  # the prompt the neighbour prefills again and again in its "prefill" mode
TIMED_BATCH = (4, 256)  # the profiling engine's decode batch, timed alone and beside it
TIMED_PROMPT = 192  # the profiling engine's prompt step, timed alone and beside it
ROUNDS, ROUND_STEPS = 4, 8  # alternations of (neighbour paused, neighbour running), steps timed in each
PROMPT_STEPS = 2  # prompt steps timed in each half of a round (each about half a second here)


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


def _prompt_times(engine, n: int, seed: int) -> list[float]:  # noqa: ANN001
    """`n` lone prompt steps of `TIMED_PROMPT` fresh tokens each (no prefix-cache hit), timed."""
    from splitserve.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True, detokenize=False)
    times = []
    for prompt in random_prompts(n, TIMED_PROMPT, engine.model_config.vocab_size, seed):
        rid = engine.add_request(prompt, params)
        times += _step_times(engine, 1)
        drain(engine, [rid])
    return times


def _alternate(proc: subprocess.Popen, timed) -> tuple[list[float], list[float]]:  # noqa: ANN001
    """`timed(round, beside)` -> step times, with the neighbour paused and running in turn."""
    alone: list[float] = []
    beside: list[float] = []
    for r in range(ROUNDS):
        proc.send_signal(signal.SIGSTOP)
        alone += timed(r, False)
        proc.send_signal(signal.SIGCONT)
        time.sleep(0.1)  # its step under way again
        beside += timed(r, True)
    return alone, beside


def _ratio(alone: list[float], beside: list[float]) -> float:
    return max(1.0, statistics.median(beside) / statistics.median(alone))


def measure_corun(engine, config, cpus: Sequence[int], log=print) -> dict[str, float]:  # noqa: ANN001
    """The four factors for `engine` (built from the EngineConfig `config`), the neighbour pinned to
    `cpus`: {"corun_factor", "corun_prefill_factor", "corun_decode_prefill_factor",
    "corun_prefill_prefill_factor"} (StepCost's fields)."""
    from splitserve.sampling.params import SamplingParams

    params = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True, detokenize=False)
    vocab = engine.model_config.vocab_size
    out: dict[str, float] = {}
    for mode, (decode_key, prompt_key) in (
        ("decode", ("corun_factor", "corun_prefill_factor")),
        ("prefill", ("corun_decode_prefill_factor", "corun_prefill_prefill_factor")),
    ):
        proc = _neighbour_process(config, cpus, mode)
        try:
            ids = [engine.add_request(p, params) for p in random_prompts(*TIMED_BATCH, vocab, 7)]
            _step_times(engine, 3)  # the prompts' step(s) and the first decode step
            try:
                alone, beside = _alternate(proc, lambda r, b: _step_times(engine, ROUND_STEPS))
            finally:
                drain(engine, ids)
            out[decode_key] = _ratio(alone, beside)
            base = 500 if mode == "decode" else 700

            def prompts(r: int, b: bool, base: int = base) -> list[float]:
                return _prompt_times(engine, PROMPT_STEPS, base + 10 * r + b)

            pa, pb = _alternate(proc, prompts)
            out[prompt_key] = _ratio(pa, pb)
        finally:
            _stop(proc)
        med = {
            k: statistics.median(v) * 1e3 for k, v in (("a", alone), ("b", beside), ("pa", pa), ("pb", pb))
        }
        log(
            f"  co-run beside a neighbour in {mode}: a decode step {med['a']:.1f} ms alone, "
            f"{med['b']:.1f} ms beside; a {TIMED_PROMPT}-token prompt step {med['pa']:.0f} ms alone, "
            f"{med['pb']:.0f} ms beside"
        )
    return out


def _neighbour_process(config, cpus: Sequence[int], mode: str) -> subprocess.Popen:  # noqa: ANN001
    spec = json.dumps({"config": dataclasses.asdict(config), "cpus": list(cpus), "mode": mode})
    argv = [sys.executable, "-m", "splitserve.plan.corun"]
    proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(spec + "\n")
    proc.stdin.flush()
    if proc.stdout.readline().strip() != "running":
        _stop(proc)
        raise RuntimeError("the co-run neighbour did not start")
    return proc


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
    """Read {config, cpus, mode} from stdin, pin, build the engine; then, until stdin closes, decode a
    batch ("decode") or prefill a prompt after another ("prefill")."""
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
    vocab = engine.model_config.vocab_size
    prefill = spec.get("mode", "decode") == "prefill"
    params = SamplingParams(
        temperature=0, max_tokens=1 if prefill else 100_000, ignore_eos=True, detokenize=False
    )
    if not prefill:
        for p in random_prompts(*NEIGHBOUR_BATCH, vocab, 11):
            engine.add_request(p, params)
        engine.step()  # the prompts: the neighbour decodes from here on
    stop = threading.Event()
    threading.Thread(target=lambda: (sys.stdin.read(), stop.set()), daemon=True).start()
    print("running", flush=True)
    seed = 0
    while not stop.is_set():
        if prefill and not engine.has_unfinished_requests():
            seed += 1  # a fresh prompt each time: no prefix-cache hit
            engine.add_request(random_prompts(1, NEIGHBOUR_PROMPT, vocab, 10_000 + seed)[0], params)
        engine.step()
    return 0


if __name__ == "__main__":
    sys.exit(_neighbour())
