"""Cores lent between the CPU workers of one host: a worker with nothing to do lends its cores to the
others until work arrives.

The local runtime splits a host's cores evenly among its CPU workers (runtime/common.py
`cpu_threads`: on 2 cores, a prefill and a decode worker get one thread each). Split for good, a core
idles whenever its worker does: the decode worker's while a prompt is prefilled before the first
import, the prefill worker's while the last answers of a burst decode, and one of the two whenever a
single request is in flight (its prefill, then its decode, each on half the host).

With lending, the runtime makes one small shared file (`create`), a slot per worker. Each engine core
(core/loop.py) writes into its slot, at each loop turn, the cores it owns when it has work and 0 when
it has none; a busy one runs with its own cores plus every core the other slots leave free
(`CoreShare.threads`), through `torch.set_num_threads`, looked up again at the checkpoints of a step
(kernels/cpu/threads.py: each layer's start, and in a prompt step each MLP product's). A worker that turns
busy takes its cores back at once, and the borrower returns them at its next checkpoint: checked only
between steps, a borrower's 2,048-token prefill step kept the core for seconds while the decode worker
shared it, and a burst ran 1.7x slower. Checked only at each layer's start, a prompt layer (~38 ms on
two threads at 1,024 tokens, an estimated twice that on one) left a core the paced decode worker had
just lent unused for, by these times, half a layer on average; the checkpoints before the MLP's products
made a P/D burst 1.09-1.29x faster (three alternating pairs, docs/bench/cpu-engine.md).
Making a worker that turns busy also wait until the borrower has let its core go (so that the two never
share one) measured no faster.
An idle worker's own background work, the KV prefault (engine/kv_prefault.py), waits while another
worker is busy (`others_busy`): it would run on the core it lends.

**Decode pacing.** Under a burst, both workers have work all the time, so nothing is lent: the decode
worker runs small batches as fast as it can (each step reads all the weights for a handful of rows)
while the prompts queue behind the prefill worker's one core. So while another worker is busy, a
decode worker that lends starts at most one step per `runtime.decode_pace_ms` (default: the ITL SLO,
`slos.itl_ms`, 200 ms) and lends its cores for the rest of that time (core/policy.py `CorePolicy.pace`):
its steps batch more rows and the prompts get most of the host. Measured (`vllm bench serve`, 64
prompts of 256 at once, the README's `splitserve serve`, one run each in one session): pace 0 (off)
124.9 / 130.9 output tok/s, mean TTFT 16.1 / 15.4 s, mean TPOT 82 / 84 ms; 150 ms 127.7; 200 ms
137.7, TTFT 13.1 s, TPOT 184 ms; 250 ms 149.6 / 143.6; 300 ms 148.8, TTFT 10.8 s, TPOT 235 ms. One
request at a time paces nothing (the prefill worker is idle while it decodes).

Measured (`vllm bench serve`, 2-vCPU Xeon, the README's `splitserve serve`, lending on and off
alternating, docs/bench/cpu-engine.md): one request at a time, mean TPOT 31.7 / 29.5 ms
against 49.0 / 49.4 ms and mean TTFT 369 / 352 against 470 / 488 ms; a burst of 64 at once is within
the noise (both workers are busy throughout, so nothing is lent).

What it may cost: the results of a step must not depend on its thread count, or a request's tokens
would depend on the other worker's timing. tests/core/test_core_share.py checks that they do not:
tokens and logprobs bit for bit at 1 and 2 threads, for the default model with every CPU op and for
the hybrid's torch path (oneDNN, MKL's GEMV and our ops split their work over rows, heads or outputs,
not over a sum). A new op that splits a sum by thread count would fail it.

`runtime.lend_cores: false` turns lending (and pacing) off; `runtime.decode_pace_ms: 0` turns pacing
off; a worker given `engine.threads` explicitly never borrows.
"""

from __future__ import annotations

import logging
import mmap
import os
from typing import Any

log = logging.getLogger(__name__)

CORES_PREFIX = "splitserve-cores-"  # the runtime's folder of the shared file (tempdirs.owned_tempdir)

SLOT_BYTES = 4  # one int32 a worker: the cores it owns while busy, 0 while idle


def create(path: str, slots: int) -> None:
    """The shared file for `slots` workers, every slot idle (0600, in the runtime's own folder)."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, bytes(SLOT_BYTES * max(1, slots)))
    finally:
        os.close(fd)


class CoreShare:
    """One worker's view of the shared file: `threads(busy)` marks its slot and says how many threads
    its next step may run (its own `own`, plus the cores of `total` the other slots leave free)."""

    def __init__(self, path: str, slot: int, own: int, total: int) -> None:
        fd = os.open(path, os.O_RDWR)
        try:
            self._map = mmap.mmap(fd, 0)
        finally:
            os.close(fd)
        self._slots = memoryview(self._map).cast("i")
        if not 0 <= slot < len(self._slots):
            raise ValueError(f"core-share slot {slot} is outside {path}'s {len(self._slots)} slots")
        self.slot, self.own, self.total = slot, max(1, own), max(1, total)
        self._mine = -1

    def threads(self, busy: bool) -> int:
        mine = self.own if busy else 0
        if mine != self._mine:  # an aligned int32 store: other readers see the old or the new value
            self._slots[self.slot] = mine
            self._mine = mine
        others = sum(self._slots) - mine
        return max(self.own, self.total - others)

    def others_busy(self) -> bool:
        """Whether another worker has work (an idle one then leaves its cores alone: no KV prefault)."""
        return sum(self._slots) - max(self._mine, 0) > 0

    def close(self) -> None:
        """Idle for good: the others may take this worker's cores."""
        try:
            self._slots[self.slot] = 0
        finally:
            self._slots.release()
            self._map.close()


def open_share(config: Any) -> CoreShare | None:
    """A worker's view of the runtime's file (`config`: its WorkerConfig), when the runtime gave one and
    the host has cores beyond this worker's; a file that cannot be opened (removed, say) leaves the
    worker on its own threads, with a warning."""
    if not config.core_share or config.core_total <= config.threads:
        return None
    try:
        return CoreShare(config.core_share, config.core_slot, config.threads, config.core_total)
    except (OSError, ValueError) as exc:  # lending is an optimization: serve without it
        log.warning("no cores lent to this worker (%s): it runs on its own %d", exc, config.threads)
        return None


__all__ = ["CORES_PREFIX", "CoreShare", "create", "open_share"]
