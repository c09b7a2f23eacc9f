"""A worker process's lines to and from its runtime (runtime/local.py), one JSON line each:

worker --Standby-->  runtime     a warm spare, imports done, waiting for its command line
worker <--Launch---  runtime     the spare's command line (on its stdin)
worker --ReadyLine-> runtime     serving: its health, where it listens, its start-up phases

and a front end's lines to and from the engine-core fork server (core/zygote.py), on a Unix socket:

front end --CoreFork-->   fork server   fork me an engine core (its stdin, stdout, stderr go with it)
front end <--CoreForked-- fork server   its pid
front end <--CoreExited-- fork server   its exit status, once it has exited (then the socket closes)
"""

from __future__ import annotations

from typing import Literal

import msgspec

from splitserve.wire.stats import Health


class StandbyLine(msgspec.Struct):
    event: Literal["standby"] = "standby"
    pid: int = 0


class Launch(msgspec.Struct, forbid_unknown_fields=True):
    argv: list[str]  # the worker's command-line arguments


class ReadyLine(Health, kw_only=True):
    event: Literal["ready"] = "ready"
    url: str
    front_end: dict[str, float]  # the front end's age at the end of each start-up phase, by phase


ZYGOTE_ENV = "SPLITSERVE_CORE_ZYGOTE"  # a front end's environment: the fork server's socket path


class CoreFork(msgspec.Struct, forbid_unknown_fields=True):
    env: dict[str, str]  # the core's environment (the front end's)


class CoreForked(msgspec.Struct):
    event: Literal["forked"] = "forked"
    pid: int = 0


class CoreExited(msgspec.Struct):
    event: Literal["exited"] = "exited"
    code: int = 0  # as subprocess's returncode: -N for a signal N


__all__ = ["ZYGOTE_ENV", "CoreExited", "CoreFork", "CoreForked", "Launch", "ReadyLine", "StandbyLine"]
