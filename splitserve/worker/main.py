"""The worker service's front end: one engine-core process (core/loop.py) behind HTTP (app.py), the
worker's operations in service.py; this module is the process's entry point.

    python -m splitserve.worker.main --role prefill --model PATH --port 0 --kv-backend tcp \
        --kv-secret-env SPLITSERVE_KV_SECRET

prints one JSON line `{"event": "ready", "url": ..., "kv_address": ..., ...}` once it serves (ports
come from the OS), then logs to stderr. Two processes: this one (HTTP, tokenization, detokenization,
stop strings, streams) and the engine core it starts (the device, the engine, the KV transport), joined
by wire/core.py. If the core dies, every request in flight fails at once and this process exits
too, so that the runtime restarts the worker.

Roles and the life of a disaggregated request through two workers (the router drives it):
  1. prefill worker, POST /prefill {prompt_token_ids, sampling_params}: the core runs the prompt,
     samples the first token, leases the blocks (and hybrid state) to the KV transport, and the answer
     is {first_token, kv_export: {handle, generator_state}}. Unclaimed, the lease ends after --kv-lease-s.
  2. decode worker, POST /decode {prompt_token_ids, first_token, kv_export, sampling_params}: the core
     reserves blocks, fetches (the transport's handshake checks the layout and the shared secret on
     first contact), has the prefill lease released, joins the batch, and this process streams NDJSON
     lines from the first token on. A failed fetch follows --kv-policy (or the body's kv_policy):
     "fail" answers an HTTP error before any line; "recompute" recomputes the prompt and streams the
     same tokens.
  colocated worker: POST /generate only (every role serves /generate: a whole request on one engine).
All roles: POST /abort, GET /health, GET /stats (queues, free blocks and state slots, KV counters).
KV plumbing: POST /kv/connect (decode: handshake with a prefill worker now, to check a pair),
POST /kv/release (prefill: end an export's lease now), POST /debug/faults (--enable-fault-injection).
"""

from __future__ import annotations

import logging
import os
import signal
import sys
from collections.abc import Sequence

import msgspec

from splitserve.config.worker import ROLES, WorkerConfig
from splitserve.core.ops import RoleError
from splitserve.core.pinning import pin
from splitserve.model.errors import ModelLoadError
from splitserve.startup_clock import mark, marks
from splitserve.transport import TransportError
from splitserve.wire.auth import worker_headers, worker_token  # noqa: F401 - re-exported
from splitserve.wire.lifecycle import Launch, ReadyLine, StandbyLine
from splitserve.worker.cli import build_parser, config_from_args
from splitserve.worker.core_client import CoreClient, CoreDead
from splitserve.worker.service import Worker

log = logging.getLogger(__name__)

__all__ = ["ROLES", "RoleError", "Worker", "WorkerConfig"]


# ---- command line --------------------------------------------------------------------------------


STANDBY = "--standby"


def standby() -> list[str]:
    """A warm spare: import what the front end needs (the HTTP stack, the tokenizer) while its engine
    core, already started, imports torch and the engine (and makes a CUDA context where there is a
    GPU); say so, and wait for the worker's command line as one JSON line on stdin. The local runtime
    keeps one, so that a restart skips interpreter start-up and imports (seconds)."""
    import splitserve.model.tokenizer  # noqa: F401 - the import is the point
    import splitserve.worker.app  # noqa: F401

    print(msgspec.json.encode(StandbyLine(pid=os.getpid())).decode(), flush=True)
    line = sys.stdin.readline()
    if not line:
        raise SystemExit(0)  # the runtime went away
    try:
        return msgspec.json.decode(line, type=Launch).argv
    except msgspec.DecodeError:
        raise SystemExit('splitserve worker: a standby wants {"argv": [str, ...]}') from None


def _settle() -> None:
    """While the engine core loads (its spec sent, our tokenizer loaded): the HTTP stack's imports (~0.2 s,
    after the spec, so that the core never waits for them), then the collector's one pass over the heap
    (`heap.py`), off the path to ready."""
    mark("tokenizer")
    import splitserve.worker.app  # noqa: F401 - the import is the point
    from splitserve.heap import freeze_heap

    freeze_heap("worker front end")
    mark("http")


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    from splitserve.heap import pause_collector

    pause_collector()  # until the core loads (`freeze_heap` below): no collector passes over the imports
    # SIGTERM before serving (a standby told to go): unwind, so that the core and its sockets go too
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    client = CoreClient.spawn()  # the core imports torch and the engine meanwhile
    try:
        if argv == [STANDBY]:
            argv = standby()
            mark("adopted")  # a spare's phases before this ran before the worker was asked for
        args = build_parser().parse_args(argv)
    except SystemExit:
        client.close(1)
        raise
    from splitserve.logs import setup_logging

    setup_logging(logging.INFO if args.verbose else logging.WARNING)  # as the router: text or JSON
    mark("imports")  # start-up phases, in the ready line (startup_clock.py)
    try:
        config = config_from_args(args)
        pin(config.cpus)  # runtime.pin_cores: the front end on its worker's own CPUs (its core pins itself)
        worker = Worker(config, client, while_loading=_settle)
    except SystemExit:  # SIGTERM while loading
        client.close(1)
        raise
    except (ValueError, OSError, ModelLoadError, TransportError, CoreDead) as exc:
        client.close(1)
        if not isinstance(exc, CoreDead):  # the core said why itself, on our stderr
            print(f"splitserve worker: error: {exc}", file=sys.stderr)
        return 2

    from splitserve.worker.app import serve

    def ready(url: str) -> None:
        mark("ready")
        line = ReadyLine(**msgspec.structs.asdict(worker.health()), url=url, front_end=marks())
        print(msgspec.json.encode(line).decode(), flush=True)

    serve(worker, config.kv_host, args.port, ready)
    return 0


if __name__ == "__main__":
    sys.exit(main())
