"""An import's outcome always reaches the front end, however the engine core came to take it.

A KV load ends on a fetch thread; the engine takes its outcome when it next polls the connector: in a
step, and also outside one (a `stats` call, a decode pace's polls). The core told the front end only
after a step, so an import that failed while nothing else was left to step was never answered: its
/decode stream waited for good (CI: a prefill worker's engine core was killed, the decode worker's
fetch from it was refused, the client timed out at 120 s). Here the real engine core, in this
process, takes a failed load's outcome through `engine.stats()` before its loop runs: the loop must
still send the refusal."""

from __future__ import annotations

import socket
import threading
import time
from pathlib import Path

import pytest
import zmq

from splitserve.engine.config import EngineConfig
from splitserve.serve import core_protocol as wire
from splitserve.serve.core import EngineCore
from splitserve.serve.worker_config import WorkerConfig

pytestmark = pytest.mark.slow


def test_an_import_that_fails_outside_a_step_is_refused(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr("splitserve.serve.heap.freeze_heap", lambda what: None)  # not pytest's heap
    gone = str(tmp_path / "gone.sock")  # a dead exporter's socket: its file stays, nobody listens
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
    core = EngineCore(config, commands, batches)
    assert core.connector is not None and core.connector.transport is not None
    handle = {
        "backend": "shm", "address": f"unix:{gone}",  # an exporter that died: refused
        "request_id": "r1", "lease_id": "l1", "block_ids": [0], "num_tokens": 4,
        "layout_fingerprint": core.connector.layout.fingerprint, "lease_expires_at": time.time() + 30,
    }  # fmt: skip
    runner: threading.Thread | None = None
    try:
        core._apply(wire.Import("r1", [1, 2, 3, 4], 5, {"handle": handle}, {"max_tokens": 4}, timeout_s=5))
        deadline = time.monotonic() + 10
        while core.engine.has_unfinished_requests():  # the load starts, fails; a stats call takes it
            assert time.monotonic() < deadline, "the load never ended"
            core.engine.stats()
            time.sleep(0.01)
        runner = threading.Thread(target=core.run, daemon=True)
        runner.start()
        got: list[wire.Event] = []
        while not any(isinstance(e, wire.Refused) for e in got):
            assert out.poll(5000), f"no refusal for the failed import; events: {got}"
            got += wire.batch_decoder.decode(out.recv()).events
        refused = next(e for e in got if isinstance(e, wire.Refused))
        assert refused.request_id == "r1" and refused.error.status == 502, refused
        assert "Connection refused" in refused.error.message, refused
    finally:
        core.stopping = True
        core.wake()
        if runner is None:
            core.close()  # run() closes it on its way out
        else:
            runner.join(10)
            assert not runner.is_alive()
        for s in (commands, feed, batches, out):
            s.close(0)
        ctx.term()
