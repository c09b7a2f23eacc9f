"""Engines at several tensor-parallel sizes, and requests run colocated or handed from a prefill engine
to a decode engine, in one test process: shared by the CPU's tests/kv_transfer/test_tp_disagg.py and
the GPU's tests/gpu/test_tp_disagg_gpu.py (tests/ is on sys.path, see tests/conftest.py)."""

from __future__ import annotations

import time
from typing import Any

from splitserve import SamplingParams
from splitserve.config.engine import EngineConfig
from splitserve.engine.engine import LLMEngine
from splitserve.engine.kv_connector import KVConnector
from splitserve.transport import TransportOptions

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


class Engines:
    """One engine (with its connector) per (model, size, backend, name), made on first use, on `device`
    (fp32, 128-token contexts); `config` adds EngineConfig fields, a function of (size, backend)."""

    def __init__(
        self,
        secret: str,
        device: str = "cpu",
        kv_bytes: int = 1 << 20,
        fetch_timeout_s: float = 20.0,
        config: Any = None,
    ) -> None:
        self.made: dict[tuple, tuple[LLMEngine, KVConnector]] = {}
        self.secret, self.device, self.kv_bytes = secret, device, kv_bytes
        self.fetch_timeout_s = fetch_timeout_s
        self.config = config or (lambda size, backend: {})

    def get(
        self, model: str, size: int, backend: str = "tcp", name: str = "a"
    ) -> tuple[LLMEngine, KVConnector]:
        key = (model, size, backend, name)
        if key not in self.made:
            config = EngineConfig(model=model, device=self.device, dtype="float32", max_model_len=128,
                                  kv_cache_bytes=self.kv_bytes, max_num_seqs=4, tensor_parallel_size=size,
                                  progress=False, **self.config(size, backend))  # fmt: skip
            engine = LLMEngine(config, tokenizer=None)
            options = TransportOptions(lease_s=30.0, fetch_timeout_s=self.fetch_timeout_s)
            self.made[key] = engine, KVConnector.open(engine, backend, secret=self.secret, options=options)
        return self.made[key]

    def close(self) -> None:
        for engine, conn in self.made.values():
            conn.close()
            if engine.config.tensor_parallel_size > 1:
                engine.runner.close()


def run(engine: LLMEngine) -> dict:
    """Step `engine` until it has nothing left; its finished outputs by request id."""
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    return done


def colocated(
    engine: LLMEngine, prompts: list[list[int]], params: SamplingParams = GREEDY
) -> list[list[int]]:
    for i, p in enumerate(prompts):
        engine.add_request(p, params, request_id=f"c{i}")
    done = run(engine)
    return [done[f"c{i}"].outputs[0].token_ids for i in range(len(prompts))]


def disaggregated(
    p: LLMEngine, d: LLMEngine, prompts: list[list[int]], tag: str, params: SamplingParams = GREEDY
) -> list[list[int]]:
    """Each prompt prefilled on `p` (its first token there); `d` fetches its KV and state and decodes."""
    for i, prompt in enumerate(prompts):
        p.add_request(prompt, params, request_id=f"{tag}p{i}", kv_transfer="export")
    exported = run(p)
    for i, prompt in enumerate(prompts):
        out = exported[f"{tag}p{i}"]
        d.add_request_with_kv(out.kv_export.handle, prompt, out.outputs[0].token_ids[0], params, f"{tag}d{i}")
    done = run(d)
    return [done[f"{tag}d{i}"].outputs[0].token_ids for i in range(len(prompts))]


def all_free(engine: LLMEngine, timeout_s: float = 10.0) -> bool:
    """Whether every block and state slot of `engine` is free (released leases freed) within `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while True:
        engine.free_released_kv()
        free = (
            engine.pool.num_free == engine.pool.num_blocks
            and engine.states.num_free == engine.states.num_slots
        )
        if free or time.monotonic() > deadline:
            return free
        time.sleep(0.05)
