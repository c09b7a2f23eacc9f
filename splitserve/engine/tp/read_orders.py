"""Rank 0's orders to the other ranks: to read their share of a KV import, and to serve their share
of an export (rank_exports.py), over one connection to each rank's process; and their outcomes.

Rank 0 reads its own share (rank_reads.py's `RankReader`) and sends every other rank an order to read
its own, over a connection to that rank's process; each rank reads with channels of its own into its
own pool (`RankReadService`, threads of that rank's process) and answers with its outcome. Rank 0
waits for every rank's outcome before the fetch returns or raises: a failure on any rank fails the
request on all (the connector then ends every exporter lease, the engine frees the blocks on every
rank; a rank that read drops the state it kept), and no rank still writes into blocks once they are
freed. Each rank is given the fetch's deadline less a margin.

    rank 0 (`RemoteReads`)                       rank r > 0 (`RankReadService`)
    ReadOrder(seq, handle, into, ...) ─────────▶ RankReader.read(...) into rank r's pool; keep(state)
                                      ◀───────── ReadDone(seq, bytes by prefill rank, pid | error)

Exports go the same way (`ask` / `answer`; a rank's lease ending comes back as `Freed`), each on a
thread of the rank's own that takes them in order.

The connections: rank 0 listens on a loopback port and posts it, with a random key each side proves
(multiprocessing.connection's handshake), in the group's store; each rank connects when it starts.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import threading
import time
from collections import Counter
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from multiprocessing.connection import Client, Connection, Listener

import torch
import torch.distributed as dist

from splitserve.engine.tp.rank_exports import ExportDone, ExportOrder, Freed, RankExporter
from splitserve.engine.tp.rank_reads import RankReader, drop, fetch_only, keep
from splitserve.model.config import ModelConfig
from splitserve.transport.backends import make_transport
from splitserve.transport.errors import PeerRefused, TransferTimeout, TransportError
from splitserve.transport.layout import KVLayout
from splitserve.transport.transport import KVTransport, TransportOptions
from splitserve.wire.kv_handle import KVHandle

log = logging.getLogger(__name__)

MARGIN_S = 0.25  # a rank's reads end this much before rank 0 stops waiting for them
WHERE_KEY = "tp-read/where"  # the store key of rank 0's listener (port and key)


@dataclass(frozen=True)
class Reach:
    """How a rank opens its channels: the connector's backend, secret and transport options."""

    backend: str
    secret: bytes | str | None
    options: object


@dataclass(frozen=True)
class ReadOrder:
    seq: int
    handle: KVHandle | None  # None: forget the state kept for order `drop` (the import failed elsewhere)
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


class RankReadService:
    """Rank r > 0: connect to rank 0 (once it posts where), then read every order it sends, each on a
    thread of a small pool, and answer with the outcome; carry out its export orders, in order, on a
    thread of their own, over this rank's exporter (`states`: this rank's state tensors by name)."""

    def __init__(
        self, port: int, rank: int, size: int, kv: torch.Tensor, states: dict[str, torch.Tensor]
    ) -> None:
        self.port, self.rank, self.size, self.kv, self.states = port, rank, size, kv, states
        self.readers: dict[tuple, RankReader] = {}
        self._pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix=f"tp-read-{rank}")
        self._exports = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"tp-export-{rank}")
        self._send_lock = threading.Lock()
        self._conn: Connection | None = None
        threading.Thread(target=self._loop, name=f"tp-read-orders-{rank}", daemon=True).start()

    def _loop(self) -> None:
        """Serve rank 0's connector; when it closes (a role switch opens another), connect to the next."""
        store = dist.TCPStore("127.0.0.1", self.port, self.size, False)  # this thread's own client
        while True:
            try:
                where = json.loads(store.get(WHERE_KEY))
                conn = Client(("127.0.0.1", where["port"]), authkey=bytes.fromhex(where["key"]))
            except Exception:  # noqa: BLE001 - none posted yet, or a closed one: try again
                time.sleep(0.2)
                continue
            conn.send(self.rank)
            with self._send_lock:
                self._conn = conn
            exporter = RankExporter(self.rank, self.kv, self.states, self._reply)
            self._serve_orders(conn, exporter)
            self._exports.submit(exporter.close)  # rank 0's connector closed: so do this rank's leases

    def _serve_orders(self, conn: Connection, exporter: RankExporter) -> None:
        while True:
            try:
                order: ReadOrder | ExportOrder = conn.recv()
            except (EOFError, OSError):
                return
            if isinstance(order, ExportOrder):
                self._exports.submit(lambda o=order: self._reply(exporter.answer(o)))
            elif order.handle is None:
                drop(order.drop)
            else:
                self._pool.submit(self._serve, order)

    def _reply(self, message: object) -> None:
        with self._send_lock, contextlib.suppress(OSError):  # rank 0's connector closed: nobody waits
            assert self._conn is not None
            self._conn.send(message)

    def _serve(self, order: ReadOrder) -> None:
        done = ReadDone(order.seq, os.getpid())
        try:
            reader = self._reader(order)
            nbytes, by_src = reader.nbytes, Counter(reader.by_src)
            deadline = time.monotonic() + order.timeout_s
            state = reader.read(order.handle, order.into, deadline, order.whole)  # type: ignore[arg-type]
            keep(order.seq, state)
            read = {p: n - by_src[p] for p, n in reader.by_src.items() if n > by_src[p]}
            done = ReadDone(order.seq, os.getpid(), reader.nbytes - nbytes, read, tuple(state))
        except Exception as exc:  # noqa: BLE001 - every failure goes back to rank 0
            mismatches = list(getattr(exc, "mismatches", None) or [])
            done = ReadDone(order.seq, os.getpid(), error=(type(exc).__name__, str(exc), mismatches))
        self._reply(done)

    def _reader(self, order: ReadOrder) -> RankReader:
        assert order.reach is not None and order.cfg is not None and order.full is not None
        key = (order.reach, order.full.fingerprint)
        if key not in self.readers:
            reach = order.reach

            def opener(kv: torch.Tensor, layout: KVLayout) -> KVTransport:  # a fetch-only channel
                options = fetch_only(reach.options or TransportOptions())
                return make_transport(reach.backend, kv, layout, secret=reach.secret, options=options)

            self.readers[key] = RankReader(order.cfg, order.full, self.rank, self.size, self.kv, opener)
        return self.readers[key]


class RemoteReads:
    """Rank 0: orders to ranks 1..size-1 and their outcomes, over one connection to each; `on_freed`
    hears of each rank's export leases ending."""

    def __init__(self, store: dist.Store, size: int, reach: Callable[[], Reach]) -> None:
        self.size, self.reach = size, reach
        self.on_freed: Callable[[list[int]], None] | None = None
        key = secrets.token_bytes(16)
        self._listener = Listener(("127.0.0.1", 0), authkey=key)
        self._conns: dict[int, Connection] = {}
        self._joined = threading.Condition()
        self._next = [0] * size
        self._outcomes: dict[tuple[int, int], ReadDone | ExportDone] = {}
        self._abandoned: set[tuple[int, int]] = set()  # orders whose wait ended before their outcome
        self._gone: set[int] = set()  # ranks whose connection closed
        self._arrived = threading.Condition()
        self._send_lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, name="tp-read-accept", daemon=True).start()
        store.set(WHERE_KEY, json.dumps({"port": self._listener.address[1], "key": key.hex()}))

    def _accept(self) -> None:
        for _ in range(1, self.size):
            conn = self._listener.accept()
            rank = int(conn.recv())
            with self._joined:
                self._conns[rank] = conn
                self._joined.notify_all()
            threading.Thread(
                target=self._receive, args=(rank, conn), name=f"tp-read-{rank}", daemon=True
            ).start()

    def _receive(self, rank: int, conn: Connection) -> None:
        while True:
            try:
                done: ReadDone | ExportDone | Freed = conn.recv()
            except (EOFError, OSError, TypeError):  # TypeError: `close` closed it under this read
                if not self._closed:
                    log.warning("tensor-parallel rank %d's order connection closed", rank)
                with self._arrived:
                    self._gone.add(rank)
                    self._arrived.notify_all()
                return
            if isinstance(done, Freed):
                if self.on_freed is not None:
                    self.on_freed(list(done.block_ids))
                continue
            with self._arrived:
                late = (rank, done.seq) in self._abandoned
                self._abandoned.discard((rank, done.seq))
                if not late:
                    self._outcomes[(rank, done.seq)] = done
                    self._arrived.notify_all()
            if late and isinstance(done, ReadDone) and done.error is None:
                self.drop(rank, done.seq)

    def _send(self, rank: int, order: ReadOrder, deadline: float) -> None:
        with self._joined:
            if not self._joined.wait_for(lambda: rank in self._conns, max(0.0, deadline - time.monotonic())):
                raise TransferTimeout(f"decode rank {rank} has not connected for reads")
            conn = self._conns[rank]
        with self._send_lock:
            conn.send(order)

    def _seq(self, rank: int) -> int:
        with self._send_lock:
            seq, self._next[rank] = self._next[rank], self._next[rank] + 1
        return seq

    def start(
        self, handle: KVHandle, into: Sequence[int], deadline: float, whole: bool, cfg: ModelConfig,
        full: KVLayout,
    ) -> list[int]:  # fmt: skip
        """Order ranks 1..size-1 to read their shares; -> each one's order seq (rank order)."""
        left = deadline - time.monotonic()
        timeout = max(0.05, left - min(MARGIN_S, 0.1 * left))
        seqs: list[int] = []
        try:
            for rank in range(1, self.size):
                seq = self._seq(rank)
                self._send(
                    rank,
                    ReadOrder(seq, handle, list(into), timeout, whole, cfg, full, self.reach()),
                    deadline,
                )
                seqs.append(seq)
        except BaseException:
            self.wait(seqs, time.monotonic() + timeout)  # the ranks ordered end their reads first
            raise
        return seqs

    def wait(self, seqs: Sequence[int], deadline: float) -> list[ReadDone | BaseException]:
        """Each rank's outcome (rank order, from rank 1), or a TransferTimeout where none came in time."""
        return [self._outcome(rank, seq, deadline, "its read") for rank, seq in enumerate(seqs, start=1)]  # type: ignore[misc]

    def ask(self, rank: int, order: Callable[[int], ExportOrder], deadline: float) -> int:
        """Send rank `rank` the export order `order(seq)`; -> its seq, for `answer`."""
        seq = self._seq(rank)
        self._send(rank, order(seq), deadline)
        return seq

    def answer(self, rank: int, seq: int, deadline: float) -> ExportDone | BaseException:
        """Rank `rank`'s answer to export order `seq`, or why none came."""
        return self._outcome(rank, seq, deadline, "its export order")  # type: ignore[return-value]

    def _outcome(
        self, rank: int, seq: int, deadline: float, what: str
    ) -> ReadDone | ExportDone | BaseException:
        key = (rank, seq)
        with self._arrived:
            left = max(0.0, deadline - time.monotonic())
            self._arrived.wait_for(lambda: key in self._outcomes or rank in self._gone, left)
            done = self._outcomes.pop(key, None)
            if done is None:
                self._abandoned.add(key)
        if done is not None:
            return done
        if rank in self._gone:
            return TransportError(f"tensor-parallel rank {rank}'s process is gone")
        return TransferTimeout(f"tensor-parallel rank {rank} did not finish {what} within the deadline")

    def drop(self, rank: int, seq: int) -> None:
        """Rank `rank` forgets the state it read for order `seq` (the import failed elsewhere)."""
        self._send(rank, ReadOrder(self._seq(rank), None, drop=seq), time.monotonic() + 1.0)

    def close(self) -> None:
        self._closed = True
        self._listener.close()
        for conn in list(self._conns.values()):
            conn.close()


__all__ = ["MARGIN_S", "Reach", "RankReadService", "ReadDone", "ReadOrder", "RemoteReads"]
