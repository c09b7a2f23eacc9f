"""The KV transport interface, its options and counters.

Life of one request's KV (prefill worker P exports, decode worker D fetches):
  1. P: `handle = t.export(request_id, block_ids, num_tokens, state)` puts the blocks under a lease
     (they stay in P's cache, untouched) and returns a JSON-able `KVHandle`.
  2. The handle travels P -> router -> D.
  3. D: allocates its own blocks, `state = t.fetch(handle, into_block_ids, timeout_s)`: connects to
     P's server (handshake: layouts + shared secret), pulls the payload into `kv[into_block_ids]`,
     checks the checksum, returns the state tensors.
  4. D: `t.release(handle)`; P's lease ends and its `on_free(block_ids)` runs exactly once. If D never
     releases (crash, lost message), the lease expires after `lease_s` and frees the blocks the same way.

Backends are opened by name with `backends.make_transport`.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections import Counter, deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from splitserve.transport.fault_plan import FaultPlan
from splitserve.transport.layout import KVLayout
from splitserve.wire.kv_handle import KVHandle
from splitserve.wire.transport_info import TransportInfo

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class TransportOptions:
    host: str = "127.0.0.1"  # where the exporter listens (tcp)
    port: int = 0  # 0: the OS picks; the handle carries the real address
    lease_s: float = 30.0  # kv_lease_s: how long exported blocks are held without a release
    fetch_timeout_s: float = 30.0  # default deadline of one fetch (connect + handshake + payload)
    connect_timeout_s: float = 5.0  # connect + handshake, and a release round trip
    idle_timeout_s: float = 300.0  # an exporter closes a connection idle this long
    max_fetch_s: float = 600.0  # cap on the deadline a fetcher may ask the exporter to honour
    checksum: str | None = None  # "crc32" | "blake2b": computed at export, verified on fetch
    socket_dir: str | None = None  # shm: where the control socket lives (default: a fresh temp dir)
    shm_chunk_mb: int = 16  # shm: the payload streams through two slots of this size
    # nixl: NIXL backends to instantiate, first that works wins; a later one is a fallback (logged,
    # counted, and failing `verify` unless required_backends names it: "nixl/UCX")
    nixl_backends: tuple[str, ...] = ("UCX",)
    # cuda_ipc, hybrid models: exported state waits in this many GPU rows of the exporter (a full
    # arena sends it the host way) and travels in this dtype (transport/state_arena.py)
    state_arena_rows: int = 8
    state_wire_dtype: str = "float32"


@dataclass(frozen=True)
class ExportRequest:
    """One request's KV to put under a lease, as `KVTransport.export` is asked for it: the blocks
    holding its first `num_tokens` tokens, and its state tensors (hybrid models) or None."""

    request_id: str
    block_ids: Sequence[int]
    num_tokens: int
    state: Mapping[str, torch.Tensor] | None = None


@dataclass(frozen=True)
class FetchRequest:
    """One handle's KV to fetch, as `KVTransport.fetch` is asked for it: our blocks to write it into,
    the deadline in seconds (None: `fetch_timeout_s`), and the engine's state slot views to write the
    state into where the backend moves it in place (else None)."""

    handle: KVHandle
    into_block_ids: Sequence[int]
    timeout_s: float | None = None
    into_state: Mapping[str, torch.Tensor] | None = None


class TransportStats:
    """Thread-safe counters and recent transfer rates, for describe()."""

    def __init__(self, backend: str, window: int = 16) -> None:
        self.backend = backend
        self.requested = backend
        self.fallback_reasons: list[str] = []
        self.peer: str | None = None
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._errors: Counter[str] = Counter()
        self._fetched: deque[tuple[int, float]] = deque(maxlen=window)
        self._served: deque[tuple[int, float]] = deque(maxlen=window)

    def count(self, name: str, n: int = 1) -> None:
        with self._lock:
            self._counts[name] += n

    def error(self, exc: BaseException) -> None:
        with self._lock:
            self._errors[type(exc).__name__] += 1

    def fetched(self, nbytes: int, seconds: float, peer: str) -> None:
        with self._lock:
            self._counts["fetches"] += 1
            self._counts["fetched_bytes"] += nbytes
            self._fetched.append((nbytes, seconds))
            self.peer = peer

    def served(self, nbytes: int, seconds: float) -> None:
        with self._lock:
            self._counts["served"] += 1
            self._counts["served_bytes"] += nbytes
            self._served.append((nbytes, seconds))

    def fell_back(self, requested: str, reasons: Sequence[str]) -> None:
        with self._lock:
            self.requested = requested
            self.fallback_reasons = list(reasons)
            self._counts["fallbacks"] += 1

    def snapshot(self) -> dict:
        with self._lock:
            return {
                "backend": self.backend,
                "requested": self.requested,
                "fallback_reasons": list(self.fallback_reasons),
                "peer": self.peer,
                "fetch_gbps_last": _gbps(list(self._fetched)[-1:]),
                "fetch_gbps_recent": _gbps(self._fetched),
                "serve_gbps_recent": _gbps(self._served),
                "counts": dict(self._counts),
                "errors": dict(self._errors),
            }


def _gbps(samples: Sequence[tuple[int, float]] | deque) -> float | None:
    nbytes = sum(n for n, _ in samples)
    seconds = sum(s for _, s in samples)
    return round(nbytes / seconds / 1e9, 3) if seconds > 0 else None


class KVTransport(ABC):
    """Moves a request's KV blocks (and state tensors) from an exporting worker to a fetching one.

    The whole contract a caller may use, by side:
        exporter   listen() -> address; export(...) -> KVHandle; release(handle); address
                   (a transport implements export_request(ExportRequest) and fetch_request(FetchRequest),
                   which export and fetch build)
        fetcher    fetch(handle, into_block_ids, ...) -> state; release(handle); check_peer(address)
        both       register_states(states); describe(); close(); stats; install_faults(plan) (tests)
    channel.py's `KVChannel` implements it for every backend (a control channel holding the backend's
    payload mover); faults.py and throttle.py wrap one for tests.
    """

    backend: str
    kv_cache: torch.Tensor  # [num_blocks, L, 2, block_size, KVH, D]: the cache the blocks live in
    layout: KVLayout
    stats: TransportStats

    # -- exporter side ---------------------------------------------------------------------------
    def export(
        self,
        request_id: str,
        block_ids: Sequence[int],
        num_tokens: int,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> KVHandle:
        """Lease the blocks (and copy the small state tensors, or keep them in their registered slot:
        `register_states`) and return a handle to fetch them by."""
        return self.export_request(ExportRequest(request_id, block_ids, num_tokens, state))

    @abstractmethod
    def export_request(self, request: ExportRequest) -> KVHandle:
        """`export`, the request as one record: what a transport implements."""

    @abstractmethod
    def release(self, handle: KVHandle) -> None:
        """End the handle's lease (locally or at the exporter). Twice, or after expiry, is harmless."""

    # -- fetcher side ----------------------------------------------------------------------------
    def fetch(
        self,
        handle: KVHandle,
        into_block_ids: Sequence[int],
        timeout_s: float | None = None,
        into_state: Mapping[str, torch.Tensor] | None = None,
    ) -> dict[str, torch.Tensor]:
        """Write the handle's blocks into our kv[into_block_ids]; return its state tensors: CPU copies,
        or `into_state` itself (views of the engine's slot) where the transport wrote them in place."""
        return self.fetch_request(FetchRequest(handle, into_block_ids, timeout_s, into_state))

    @abstractmethod
    def fetch_request(self, request: FetchRequest) -> dict[str, torch.Tensor]:
        """`fetch`, the request as one record: what a transport implements."""

    def register_states(self, states: Mapping[str, torch.Tensor]) -> bool:
        """Offer the engine's state-slot tensors ([num_slots, *shape] each), once, at start. True: this
        transport moves a request's state straight out of its slot (which the engine then keeps under
        the export's lease, freed when it ends) and into `into_state`. Default: False (copies)."""
        return False

    @abstractmethod
    def listen(self) -> str:
        """Exporter: start serving (once); -> the address handles carry."""

    @property
    @abstractmethod
    def address(self) -> str | None:
        """Where this transport serves (None before `listen`)."""

    @abstractmethod
    def check_peer(self, address: str, timeout_s: float) -> KVLayout:
        """Fetcher: connect (and handshake) with the exporter at `address` now; -> its layout. Raises
        PeerRefused / AuthError."""

    @abstractmethod
    def install_faults(self, plan: FaultPlan | None) -> None:
        """Tests: break the exporter's answers according to `plan` (fault_plan.py); None: stop."""

    @abstractmethod
    def describe(self) -> TransportInfo:
        """Backend actually running, peer, measured GB/s of recent transfers, counts (the struct a
        worker's /stats carries, wire/transport_info.py)."""

    @abstractmethod
    def close(self) -> None:
        """Stop serving and free every lease still held."""

    def __enter__(self) -> KVTransport:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
