"""Fault injection for the error paths: an exporter that drops, stalls, corrupts or hangs up.

`FaultyTransport(inner, drop=.., delay=.., corrupt=.., kill=.., seed=..)` wraps a socket transport
(tcp or shm) and installs a `FaultPlan` on its server. For every fetch the server serves, the plan
draws one fault (seeded, so a test is repeatable):

    drop     never answer: the fetcher must time out (TransferTimeout) within its deadline
    delay    sleep `delay_s` before answering (past the fetcher's deadline if it is longer)
    corrupt  flip bytes of the payload on its way out: a checksum must catch it (CorruptTransfer)
    kill     hang up half-way through the payload: the fetcher gets TransportError, never hangs

Everything else is passed through to the inner transport, so fetch / export / release / describe
behave as they would in production.
"""

from __future__ import annotations

import random
import threading
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import TYPE_CHECKING

import numpy as np
import torch

from splitserve.kv.handle import KVHandle
from splitserve.kv.payload import ByteStream
from splitserve.kv.transport import KVTransport

if TYPE_CHECKING:
    from splitserve.kv.socket_transport import SocketTransport


class Fault(StrEnum):
    NONE = "none"
    DROP = "drop"
    DELAY = "delay"
    CORRUPT = "corrupt"
    KILL = "kill"


@dataclass(frozen=True)
class FaultKnobs:
    drop: float = 0.0  # probabilities, each in [0, 1], summing to at most 1
    delay: float = 0.0
    corrupt: float = 0.0
    kill: float = 0.0
    delay_s: float = 5.0
    seed: int = 0

    def __post_init__(self) -> None:
        probs = (self.drop, self.delay, self.corrupt, self.kill)
        if any(p < 0 for p in probs) or sum(probs) > 1 + 1e-9:
            raise ValueError(f"fault probabilities must be >= 0 and sum to <= 1, got {probs}")


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


class FaultyTransport(KVTransport):
    """A tcp or shm transport whose exporter misbehaves on purpose (tests of the error paths)."""

    def __init__(
        self,
        inner: SocketTransport,
        *,
        drop: float = 0.0,
        delay: float = 0.0,
        corrupt: float = 0.0,
        kill: float = 0.0,
        delay_s: float = 5.0,
        seed: int = 0,
    ) -> None:
        self.inner = inner
        self.backend = inner.backend
        self.plan = FaultPlan(FaultKnobs(drop, delay, corrupt, kill, delay_s, seed))
        inner.install_faults(self.plan)

    def export(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> KVHandle:
        return self.inner.export(request_id, block_ids, num_tokens, state)

    def release(self, handle: KVHandle) -> None:
        self.inner.release(handle)

    def fetch(
        self,
        handle: KVHandle,
        into_block_ids: Sequence[int],
        timeout_s: float | None = None,
        into_state: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        return self.inner.fetch(handle, into_block_ids, timeout_s, into_state)

    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        return self.inner.register_states(states)

    def describe(self) -> dict:
        return {**self.inner.describe(), "fault_knobs": asdict(self.plan.knobs)}

    def close(self) -> None:
        self.inner.close()
