"""A worker process's lines to and from its runtime (runtime/local.py), one JSON line each:

worker --Standby-->  runtime     a warm spare, imports done, waiting for its command line
worker <--Launch---  runtime     the spare's command line (on its stdin)
worker --ReadyLine-> runtime     serving: its health, where it listens, its start-up phases
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


__all__ = ["Launch", "ReadyLine", "StandbyLine"]
