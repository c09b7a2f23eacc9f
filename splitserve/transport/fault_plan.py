"""The fault plan: which fault an exporter injects into each fetch it serves (tests of the error paths).

    drop     never answer: the fetcher must time out (TransferTimeout) within its deadline
    delay    sleep `delay_s` before answering (past the fetcher's deadline if it is longer)
    corrupt  flip bytes of the payload on its way out: a checksum must catch it (CorruptTransfer)
    kill     hang up half-way through the payload: the fetcher gets TransportError, never hangs

A transport holds no plan in production; `KVTransport.install_faults` (faults.py's `FaultyTransport`,
the worker's `/debug/faults`) installs one. The control channel draws a fault per served fetch and the
payload movers apply it.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from enum import StrEnum

import numpy as np

from splitserve.transport.payload import ByteStream
from splitserve.wire.ops import FaultKnobs  # the knobs as /debug/faults takes them


class Fault(StrEnum):
    NONE = "none"
    DROP = "drop"
    DELAY = "delay"
    CORRUPT = "corrupt"
    KILL = "kill"


class FaultPlan:
    """Draws one fault per served fetch; thread-safe and seeded."""

    def __init__(self, knobs: FaultKnobs) -> None:
        self.knobs = knobs
        self._rng = random.Random(knobs.seed)
        self._lock = threading.Lock()
        self.counts: Counter[str] = Counter()

    def draw(self) -> Fault:
        with self._lock:
            x = self._rng.random()
            fault = Fault.NONE
            for kind, p in (
                (Fault.DROP, self.knobs.drop),
                (Fault.DELAY, self.knobs.delay),
                (Fault.CORRUPT, self.knobs.corrupt),
                (Fault.KILL, self.knobs.kill),
            ):
                if x < p:
                    fault = kind
                    break
                x -= p
            self.counts[fault.value] += 1
            return fault

    def flip(self, buf: np.ndarray, nbytes: int = 8) -> None:
        """Invert a few bytes of `buf` in place."""
        with self._lock:
            where = [self._rng.randrange(buf.nbytes) for _ in range(min(nbytes, buf.nbytes))]
        for i in where:
            buf[i] ^= 0xFF

    def corrupted(self, stream: ByteStream, head: int = 4096) -> ByteStream:
        """The stream with a flipped copy of its first bytes in front of views of the rest."""
        first = stream.pieces[0]
        copy = first[:head].copy()
        self.flip(copy)
        return ByteStream([copy, first[head:], *stream.pieces[1:]])
