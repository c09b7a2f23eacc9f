"""Each decode rank's reads of an imported request, in that rank's own process, into its own pool.

A decode replica at tensor_parallel_size D fills rank d's pool from the exporter ranks that hold its
heads and state channels (kv_routes.py's `parts`), or, at the exporter's own size and rank layouts,
from its twin rank's whole shard. The reads run where the pool lives: rank 0 reads its share in its
process (`RankReader`), and sends every other rank an order, over the group's store, to read its own
share over channels of its own (`RankReadService`, a thread of that rank's process). Rank 0 waits for
every rank's outcome before the fetch returns or raises: a failure on any rank fails the request on all
(the connector then ends every exporter lease, the engine frees the blocks on every rank), and no rank
still writes into blocks that have been freed. Each rank is given the fetch's deadline less a margin.

    rank 0 (`RemoteReads`)                           rank r > 0 (`RankReadService`)
    store["tp-read/r/seq"] = ReadOrder  ───────────▶ RankReader.read(...) into rank r's pool
    ReadDone = store["tp-done/r/seq"]   ◀─────────── its bytes, by prefill rank; its pid; or the error

The state channels rank r reads stay in its process (`HELD`) until the step that hands the request its
slot: rank 0's journal carries a `Held` in place of the tensor (journal.py's "put").
"""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import pickle
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import msgspec
import torch
import torch.distributed as dist

from splitserve.engine.tp.kv_routes import Plan, Sharding, parts
from splitserve.model.config import ModelConfig
from splitserve.transport.errors import PeerRefused, TransferTimeout, TransportError
from splitserve.transport.layout import KVLayout, torch_dtype
from splitserve.transport.part_sink import PartSink
from splitserve.transport.payload import ByteStream, empty_state
from splitserve.transport.transport import FetchRequest, KVTransport
from splitserve.wire.kv_handle import KVHandle, KVShard

log = logging.getLogger(__name__)

Opener = Callable[[torch.Tensor, KVLayout], KVTransport]  # a fetch-only transport over a tensor
MARGIN_S = 0.25  # a rank's reads end this much before rank 0 stops waiting for them
HELD_MAX = 256  # imported state kept for steps to come, per rank (older ones of failed imports go)
HELD: dict[int, dict[str, torch.Tensor]] = {}  # rank r's read state by order seq, until its "put"
_held_lock = threading.Lock()


def shards_of(handle: KVHandle) -> tuple[KVShard, ...]:
    if handle.shards:
        return handle.shards
    return (KVShard(handle.address, handle.lease_id, handle.layout_fingerprint, handle.checksum),)


def shard_handle(handle: KVHandle, shard: KVShard) -> KVHandle:
    """One rank's part of `handle`, as a plain handle its transport fetches and releases by."""
    return msgspec.structs.replace(
        handle, address=shard.address, lease_id=shard.lease_id, layout_fingerprint=shard.layout_fingerprint,
        checksum=shard.checksum, tp_size=1, shards=(),
    )  # fmt: skip


def left_s(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TransferTimeout("the fetch deadline passed between the ranks' parts")
    return left


def refused(plan: Plan, exc: PeerRefused) -> PeerRefused:
    return PeerRefused(
        f"cannot map a prefill replica at tensor_parallel_size {plan.src.size} onto a decode replica "
        f"at tensor_parallel_size {plan.dst.size}",
        exc.mismatches or [str(exc)],
    )


class RankReader:
    """Decode rank `rank`'s reads into its pool `kv`, over channels of its own: one per prefill rank
    and layout for parts (a fetch-only channel: one unused block, nothing staged), and `own` (a
    channel over the pool itself) for whole shards."""

    def __init__(
        self, cfg: ModelConfig, full: KVLayout, rank: int, size: int, kv: torch.Tensor, opener: Opener,
        own: KVTransport | None = None,
    ) -> None:  # fmt: skip
        self.cfg, self.full, self.rank, self.size, self.kv, self.opener = cfg, full, rank, size, kv, opener
        self.layout = Sharding.of(cfg, size).rank_layout(full, rank)
        self.own = own
        self.peers: dict[tuple[str, int], KVTransport] = {}  # (layout fingerprint, prefill rank) -> channel
        self.by_src: Counter[int] = Counter()  # bytes the part reads took from each prefill rank
        self.nbytes = 0  # every byte written into this rank's pool and state
        self._lock = threading.Lock()

    def read(self, handle: KVHandle, into: Sequence[int], deadline: float, whole: bool) -> dict:
        """Fill our blocks `into` (and fresh state tensors, returned) with our share of `handle`."""
        shards = shards_of(handle)
        if whole:
            if self.own is None:
                self.own = self.opener(self.kv, self.layout)
            state = self.own.fetch(shard_handle(handle, shards[self.rank]), into, left_s(deadline))
            self._count(None, self.layout.payload_nbytes(len(into)))
            return state
        plan = Plan.build(self.cfg, handle.tp_size, self.size)
        state = empty_state(self.layout)
        for part in parts(plan, self.rank):
            peer = self.peer(plan.src.rank_layout(self.full, part.src), part.src)
            sink = PartSink(self.kv, self.layout, into, part.heads, state, part.states)
            request = FetchRequest(shard_handle(handle, shards[part.src]), into, left_s(deadline))
            try:
                peer.fetch_part(request, part.select, ByteStream(sink.pieces))  # type: ignore[attr-defined]
            except PeerRefused as exc:
                raise refused(plan, exc) from None
            sink.commit()
            self._count(part.src, sink.nbytes)
        return state

    def peer(self, layout: KVLayout, src: int) -> KVTransport:
        key = (layout.fingerprint, src)
        with self._lock:
            if key in self.peers:
                return self.peers[key]
        dummy = torch.empty((1, *layout.block_shape), dtype=torch_dtype(layout.dtype))
        made = self.opener(dummy, layout)  # NOTE: not under the lock (an opener may read describe())
        with self._lock:
            peer = self.peers.setdefault(key, made)
        if peer is not made:
            made.close()
        return peer

    def _count(self, src: int | None, nbytes: int) -> None:
        with self._lock:
            self.nbytes += nbytes
            if src is not None:
                self.by_src[src] += nbytes

    def close(self) -> None:
        with self._lock:
            peers, self.peers = list(self.peers.values()), {}
        for peer in peers:
            peer.close()


@dataclass(frozen=True)
class Held:
    """In rank 0's journal, in place of a state tensor: the one rank `rank` read for order `seq`."""

    rank: int
    seq: int
    name: str


def held_tensor(t: torch.Tensor | Held) -> torch.Tensor:
    """A journal's state tensor, taking a `Held` one out of this rank's `HELD`."""
    if isinstance(t, torch.Tensor):
        return t
    with _held_lock:
        state = HELD.get(t.seq, {})
        out = state.pop(t.name)
        if not state:
            HELD.pop(t.seq, None)
    return out


@dataclass(frozen=True)
class Reach:
    """How a rank opens its channels: the connector's backend, secret and transport options."""

    backend: str
    secret: bytes | str | None
    options: object


@dataclass(frozen=True)
class ReadOrder:
    seq: int
    handle: KVHandle | None  # None: drop what order `drop` kept (the import failed on another rank)
    into: list[int] = field(default_factory=list)
    timeout_s: float = 0.0
    whole: bool = False
    cfg: ModelConfig | None = None
    full: KVLayout | None = None
    reach: Reach | None = None
    drop: int = -1


@dataclass(frozen=True)
class ReadDone:
    seq: int
    pid: int
    nbytes: int = 0
    by_src: dict[int, int] = field(default_factory=dict)
    names: tuple[str, ...] = ()
    error: tuple[str, str, list[str]] | None = None  # (class name, message, mismatches)

    def exception(self, rank: int) -> BaseException | None:
        if self.error is None:
            return None
        kind, message, mismatches = self.error
        if kind == "PeerRefused":
            return PeerRefused(message, mismatches)
        if kind == "TransferTimeout":
            return TransferTimeout(f"decode rank {rank}: {message}")
        return TransportError(f"decode rank {rank}'s read failed ({kind}: {message})")


def _client(port: int, size: int) -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", port, size, False, timeout=datetime.timedelta(seconds=60))


class RankReadService:
    """Rank r > 0: read every order rank 0 sends, in order, each on a thread of a small pool."""

    def __init__(self, port: int, rank: int, size: int, kv: torch.Tensor) -> None:
        self.port, self.rank, self.size, self.kv = port, rank, size, kv
        self.readers: dict[tuple, RankReader] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"tp-read-{rank}")
        self._local = threading.local()
        threading.Thread(target=self._loop, name=f"tp-read-orders-{rank}", daemon=True).start()

    def _store(self) -> dist.TCPStore:
        if getattr(self._local, "store", None) is None:
            self._local.store = _client(self.port, self.size)
        return self._local.store

    def _loop(self) -> None:
        store = self._store()
        for seq in itertools.count():
            key = f"tp-read/{self.rank}/{seq}"
            while True:
                try:
                    data = store.get(key)
                    break
                except Exception:  # noqa: BLE001 - no order within the store's timeout: wait on
                    continue
            store.delete_key(key)
            order: ReadOrder = pickle.loads(data)
            if order.handle is None:
                with _held_lock:
                    HELD.pop(order.drop, None)
            else:
                self._pool.submit(self._serve, order)

    def _serve(self, order: ReadOrder) -> None:
        done = ReadDone(order.seq, os.getpid())
        try:
            reader = self._reader(order)
            before, src_before = reader.nbytes, Counter(reader.by_src)
            deadline = time.monotonic() + order.timeout_s
            state = reader.read(order.handle, order.into, deadline, order.whole)  # type: ignore[arg-type]
            with _held_lock:
                HELD[order.seq] = state
                while len(HELD) > HELD_MAX:
                    HELD.pop(next(iter(HELD)))
            by_src = {
                p: n - src_before.get(p, 0) for p, n in reader.by_src.items() if n - src_before.get(p, 0)
            }
            done = ReadDone(order.seq, os.getpid(), reader.nbytes - before, by_src, tuple(state))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to rank 0
            done = ReadDone(order.seq, os.getpid(), error=(type(exc).__name__, str(exc), _mismatches(exc)))
        self._store().set(f"tp-done/{self.rank}/{order.seq}", pickle.dumps(done))

    def _reader(self, order: ReadOrder) -> RankReader:
        assert order.reach is not None and order.cfg is not None and order.full is not None
        key = (order.reach, order.full.fingerprint)
        if key not in self.readers:
            from splitserve.transport import make_transport

            reach = order.reach

            def opener(kv: torch.Tensor, layout: KVLayout) -> KVTransport:
                return make_transport(reach.backend, kv, layout, secret=reach.secret, options=reach.options)

            self.readers[key] = RankReader(order.cfg, order.full, self.rank, self.size, self.kv, opener)
        return self.readers[key]


def _mismatches(exc: BaseException) -> list[str]:
    return list(getattr(exc, "mismatches", None) or [])


class RemoteReads:
    """Rank 0: orders to ranks 1..size-1 and their outcomes, over the group's store."""

    def __init__(self, port: int, size: int, reach: Callable[[], Reach]) -> None:
        self.port, self.size, self.reach = port, size, reach
        self._next = [0] * size
        self._lock = threading.Lock()
        self._local = threading.local()

    def _store(self) -> dist.TCPStore:
        if getattr(self._local, "store", None) is None:
            self._local.store = _client(self.port, self.size)
        return self._local.store

    def _send(self, rank: int, order: ReadOrder) -> None:
        self._store().set(f"tp-read/{rank}/{order.seq}", pickle.dumps(order))

    def _seq(self, rank: int) -> int:
        with self._lock:
            seq, self._next[rank] = self._next[rank], self._next[rank] + 1
        return seq

    def start(
        self, handle: KVHandle, into: Sequence[int], deadline: float, whole: bool, cfg: ModelConfig,
        full: KVLayout,
    ) -> list[int]:  # fmt: skip
        """Order ranks 1..size-1 to read their shares; -> each one's order seq (rank order)."""
        timeout = max(0.05, deadline - time.monotonic() - min(MARGIN_S, 0.1 * (deadline - time.monotonic())))
        seqs = []
        for rank in range(1, self.size):
            seq = self._seq(rank)
            self._send(rank, ReadOrder(seq, handle, list(into), timeout, whole, cfg, full, self.reach()))
            seqs.append(seq)
        return seqs

    def wait(self, seqs: Sequence[int], deadline: float) -> list[ReadDone | BaseException]:
        """Each rank's outcome (rank order, from rank 1), or a TransferTimeout where none came in time."""
        out: list[ReadDone | BaseException] = []
        store = self._store()
        for rank, seq in enumerate(seqs, start=1):
            key = f"tp-done/{rank}/{seq}"
            try:
                store.wait([key], datetime.timedelta(seconds=max(0.01, deadline - time.monotonic())))
                out.append(pickle.loads(store.get(key)))
                store.delete_key(key)
            except Exception:  # noqa: BLE001 - the store's timeout
                out.append(TransferTimeout(f"decode rank {rank} did not finish its read within the deadline"))
        return out

    def drop(self, rank: int, seq: int) -> None:
        """Rank `rank` forgets the state it read for order `seq` (the import failed elsewhere)."""
        self._send(rank, ReadOrder(self._seq(rank), None, drop=seq))


__all__ = [
    "HELD",
    "Held",
    "RankReadService",
    "RankReader",
    "Reach",
    "ReadDone",
    "ReadOrder",
    "RemoteReads",
    "held_tensor",
    "left_s",
    "shard_handle",
    "shards_of",
]
