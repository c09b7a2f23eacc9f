"""`splitserve serve` with `model.tensor_parallel_size: 2` on the CPU (gloo): the colocated worker's
engine core is rank 0 and starts rank 1 beside it. Streamed greedy answers equal one process's
(tensor_parallel_size 1); a rank killed with SIGKILL under load fails the replica's requests with a
clear error, the replica is restarted whole (a new rank 0 and rank 1), and it answers the same again."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from pathlib import Path

import openai
import pytest
from serve_harness import manifest_yaml, start_deployment

from splitserve import LLM, SamplingParams

pytestmark = pytest.mark.slow

MODEL = "random:tiny"
PROMPTS = [[5, 17, 300, 42, 7, 99, 250], list(range(1, 40))]


def _rank_pids(core_pid: int) -> list[int]:
    """The tensor-parallel ranks an engine core started (its children running tp/worker.py)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().split(") ")[1].split()
            cmd = (stat.parent / "cmdline").read_bytes()
        except (OSError, IndexError):
            continue
        if int(fields[1]) == core_pid and b"splitserve.engine.tp.worker" in cmd:
            pids.append(int(stat.parent.name))
    return pids


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().split(") ")[1]
    except (OSError, IndexError):
        return False
    return not state.startswith("Z")


async def _stream(client: openai.AsyncOpenAI, max_tokens: int) -> str:
    try:
        stream = await client.completions.create(
            model=MODEL, prompt=PROMPTS[1], max_tokens=max_tokens, temperature=0, stream=True,
            extra_body={"ignore_eos": True},
        )  # fmt: skip
        async for _ in stream:
            pass
        return "ok"
    except openai.APIError as exc:
        return type(exc).__name__


def _texts(client: openai.OpenAI) -> list[str]:
    out = []
    for prompt in PROMPTS:
        chunks = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, temperature=0,
                                           stream=True, extra_body={"ignore_eos": True})  # fmt: skip
        out.append("".join(c.choices[0].text for c in chunks if c.choices))
    return out


def test_tp2_served_streams_tp1_tokens_and_a_dead_rank_restarts_the_replica():
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    llm = LLM(model=MODEL, max_model_len=256, kv_cache_bytes=16 << 20, progress=False)
    expected = [o.outputs[0].text for o in llm.generate([{"prompt_token_ids": p} for p in PROMPTS], params)]
    dep = start_deployment(
        manifest_yaml(
            mode="colocated",
            model={"source": MODEL, "max_model_len": 2048, "tensor_parallel_size": 2},
            engine={"kv_cache_mb": 16, "max_num_seqs": 8},
            router={"timeouts": {"inter_token_s": 10}, "on_fault": "fail"},  # the rank's death is seen
        )
    )
    try:
        assert _texts(dep.client(timeout=60)) == expected
        (worker,) = dep.admin()["workers"]
        core = worker["info"]["core_pid"]
        (rank1,) = _rank_pids(core)

        async def kill_under_load() -> tuple[list[str], float]:
            client = dep.async_client(timeout=60)
            jobs = [asyncio.create_task(_stream(client, 1800)) for _ in range(3)]
            await asyncio.sleep(1.5)  # the streams are generating
            os.kill(rank1, signal.SIGKILL)
            killed = time.monotonic()
            return await asyncio.gather(*jobs), killed

        t0 = time.monotonic()
        outcomes, killed = asyncio.run(kill_under_load())
        assert outcomes and all(o != "ok" for o in outcomes), outcomes  # a clear error, not a hang ...
        assert time.monotonic() - killed < 15, "the requests outlived their deadline"
        deadline = t0 + 120
        while True:  # ... and the replica comes back whole: a new engine core with a new rank 1
            health = dep.health()
            w = health["workers"][0]
            if health["status"] == "ok" and w["restarts"] == worker["restarts"] + 1:
                break
            assert time.monotonic() < deadline, health
            time.sleep(0.2)
        assert not _alive(core) and not _alive(rank1)
        new_core = dep.admin()["workers"][0]["info"]["core_pid"]
        assert new_core != core and len(_rank_pids(new_core)) == 1
        assert _texts(dep.client(timeout=60)) == expected
        stats = dep.wait_idle(timeout_s=20)
        assert all(s["blocks"]["free"] == s["blocks"]["total"] for s in stats.values()), stats
    finally:
        assert dep.stop() == 0, "\n".join(dep.log)
