"""Warm the whole serving path before the ready line, so that a fresh deployment's first answer is as
quick as its later ones.

A fresh deployment's first request pays for work no later one does, among it (not timed one by one)
the router's first connections to the workers, the KV transport's first connection and handshake
between a prefill and a decode worker, and the engines' first steps (lazy imports, oneDNN primitives,
pages of the step's temporaries). Measured on the 2-vCPU box with the README's `splitserve serve`
(docs/bench/cpu-engine.md; the README's question, greedy, asked at once after the ready
line, two starts each): 858 / 469 ms without the warm-up, 307 / 362 ms with it; later ones 264-391 ms.

`warm_up` sends `n` short greedy requests, each a different prompt (so that prefix affinity does not
send them all to one worker), through the router's own `Dispatcher`, as a client's request goes, and
waits for them. A failure is logged and the deployment starts anyway: the gate (`splitserve verify`)
and the health checks are what judge a deployment, not its warm-up.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter

from splitserve.router.dispatch import Dispatcher
from splitserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)

PROMPT_TOKENS = 16
MAX_TOKENS = 2


async def warm_up(dispatcher: Dispatcher, roles: list[str], vocab_size: int, timeout_s: float = 60.0) -> bool:
    """One request per worker of the largest pool among `roles` (the workers' roles), at once;
    -> whether all of them answered within `timeout_s`."""
    n = max(Counter(roles).values(), default=0)
    if n == 0:
        return False
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    t0 = time.perf_counter()

    async def one(i: int) -> None:
        ids = [(1000 + 97 * i + j) % vocab_size for j in range(PROMPT_TOKENS)]
        async for _ in dispatcher.run(0, ids, params, f"warmup-{i}"):
            pass

    try:
        async with asyncio.timeout(timeout_s):
            await asyncio.gather(*(one(i) for i in range(n)))
    except Exception as exc:  # noqa: BLE001 - the deployment starts anyway; the log says why
        log.warning("warm-up request failed (%r); the first client request pays the first-use costs", exc)
        return False
    log.info("warm-up: %d request(s) through the whole path in %.0f ms", n, 1e3 * (time.perf_counter() - t0))
    return True


__all__ = ["warm_up"]
