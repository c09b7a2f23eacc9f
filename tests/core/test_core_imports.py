"""An import's outcome always reaches the front end, however the engine core came to take it.

A KV load ends on a fetch thread; the engine takes its outcome when it next polls the connector: in a
step, and also outside one (a `stats` call, a decode pace's polls). The core told the front end only
after a step, so an import that failed while nothing else was left to step was never answered: its
/decode stream waited for good (CI: a prefill worker's engine core was killed, the decode worker's
fetch from it was refused, the client timed out at 120 s). Here the real engine core, in this
process, takes a failed load's outcome through `engine.stats()` before its loop runs: the loop must
still send the refusal. And a decode pace (the core idle with its cores lent, `_lend_until`) that takes
one tells it during the pace, not after it."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import zmq

from splitserve.config.engine import EngineConfig
from splitserve.config.worker import WorkerConfig
from splitserve.core.loop import EngineCore
from splitserve.wire import core as wire

pytestmark = pytest.mark.slow


@dataclass
class Core:
    core: EngineCore
    out: zmq.Socket
    feed: zmq.Socket  # commands, as the front end sends them
    gone: str
    closed: bool = False  # by run() on its way out


@pytest.fixture
def core(tmp_path: Path, monkeypatch) -> Iterator[Core]:
    """The real engine core of a decode worker (shm), its batches read from `out`; `gone` is a dead
    exporter's socket (its file stays, nobody listens): a fetch from it is refused."""
    monkeypatch.setattr("splitserve.heap.freeze_heap", lambda what: None)  # not pytest's heap
    gone = str(tmp_path / "gone.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(gone)
    config = WorkerConfig(
        role="decode", kv_backend="shm", kv_secret="s" * 32,
        engine=EngineConfig(kv_cache_bytes=32 << 20, max_model_len=256, progress=False),
    )  # fmt: skip
    ctx = zmq.Context()
    commands, feed = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    batches, out = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    commands.bind("inproc://commands")
    feed.connect("inproc://commands")
    out.bind("inproc://batches")
    batches.connect("inproc://batches")
    engine_core = EngineCore(config, commands, batches)
    assert engine_core.connector is not None and engine_core.connector.transport is not None
    c = Core(engine_core, out, feed, gone)
    try:
        yield c
    finally:
        if not c.closed:
            engine_core.close()
        for s in (commands, feed, batches, out):
            s.close(0)
        ctx.term()


def _import_from_the_dead(c: Core, request_id: str, sent: bool = False) -> None:
    """An import of KV from the dead exporter: applied in this thread, or `sent` on the command socket."""
    assert c.core.connector is not None
    handle = {
        "backend": "shm", "address": f"unix:{c.gone}", "request_id": request_id, "lease_id": "l1",
        "block_ids": [0], "num_tokens": 4, "layout_fingerprint": c.core.connector.layout.fingerprint,
        "lease_expires_at": time.time() + 30,
    }  # fmt: skip
    cmd = wire.Import(request_id, [1, 2, 3, 4], 5, {"handle": handle}, {"max_tokens": 4}, timeout_s=5)
    if sent:
        c.feed.send(wire.command_encoder.encode(cmd))
    else:
        c.core._apply(cmd)


def _refusal(c: Core, request_id: str, within_s: float) -> wire.Refused:
    got: list[wire.Event] = []
    deadline = time.monotonic() + within_s
    while not any(isinstance(e, wire.Refused) for e in got):
        left = deadline - time.monotonic()
        assert left > 0 and c.out.poll(int(left * 1e3)), f"no refusal within {within_s} s; events: {got}"
        got += wire.batch_decoder.decode(c.out.recv()).events
    refused = next(e for e in got if isinstance(e, wire.Refused))
    assert refused.request_id == request_id and refused.error.status == 502, refused
    assert "Connection refused" in refused.error.message, refused
    return refused


def test_an_import_that_fails_outside_a_step_is_refused(core: Core) -> None:
    _import_from_the_dead(core, "r1")
    deadline = time.monotonic() + 10
    while core.core.engine.has_unfinished_requests():  # the load starts, fails; a stats call takes it
        assert time.monotonic() < deadline, "the load never ended"
        core.core.engine.stats()
        time.sleep(0.01)
    runner = threading.Thread(target=core.core.run, daemon=True)
    runner.start()
    try:
        _refusal(core, "r1", 5)
    finally:
        core.core.stopping = True
        core.core.wake()
        runner.join(10)
        assert not runner.is_alive()
        core.closed = True


def test_an_import_that_fails_during_a_pace_is_refused_in_it(core: Core) -> None:
    pace = threading.Thread(target=core.core._lend_until, args=(time.perf_counter() + 8,), daemon=True)
    t0 = time.monotonic()
    pace.start()
    _import_from_the_dead(core, "r2", sent=True)  # it comes during the pace
    try:
        _refusal(core, "r2", 5)  # the pace runs 8 s: the refusal comes during it
        assert pace.is_alive(), f"the pace ended before the refusal came ({time.monotonic() - t0:.1f} s)"
    finally:
        core.core.stopping = True  # ends the pace
        core.core.wake()
        pace.join(10)
        assert not pace.is_alive()
