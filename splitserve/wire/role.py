"""A worker that changes role (prefill <-> decode) at run time: the bodies of the edges that do it.

    router admin   POST /admin/workers/{name}/role   RoleChangeRequest -> RoleChangeResult
    runtime        POST {worker}/role                RoleSwitch        -> Health (wire/stats.py)
    router         /prefill, /decode, /kv/*          a `RoleStamp` in the body

A worker's role epoch counts its role changes (0 at its first start; a restart keeps it). The router
stamps each call with the role and epoch it picked the worker under; a worker whose role or epoch
differs answers 409 `stale_role`, and the router picks again.
"""

from __future__ import annotations

from typing import Annotated, Literal

import msgspec

SwitchRole = Literal["prefill", "decode"]
# a worker's error type for a request still in flight when it changed role (503 before a stream's first
# line; after it, a last stream line with this finish_reason): the router migrates the request
ROLE_CHANGED = "role_changed"


class RoleStamp(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """The role and epoch a caller believes the worker has."""

    role: str
    epoch: Annotated[int, msgspec.Meta(ge=0)]


class RoleChangeRequest(msgspec.Struct, forbid_unknown_fields=True):
    """Move a worker to `role`. Refused (409) when it would leave its role with no ready worker, unless
    `force`. `drain_timeout_s`: how long its requests in flight may take to finish before the rest
    migrate (default: the manifest's `runtime.drain_timeout_s`)."""

    role: SwitchRole
    force: bool = False
    reason: Annotated[str, msgspec.Meta(max_length=200)] = "admin"
    drain_timeout_s: Annotated[float, msgspec.Meta(gt=0, le=3600)] | None = None


class RoleChangeResult(msgspec.Struct):
    """One role change as it went: the seconds of each phase, and the requests its drain handed on."""

    worker: str
    from_role: str
    to_role: str
    epoch: int
    reason: str
    forced: bool
    drain_s: float
    reconfigure_s: float
    rejoin_s: float
    migrated: int  # requests still in flight at the drain deadline, migrated by the router


class RoleSwitch(msgspec.Struct, forbid_unknown_fields=True):
    """Runtime -> worker: restart the engine core with `spec` (a WorkerConfig as JSON, without the
    secret: the worker keeps its own), its role and `role_epoch` the new ones. Requests still in flight
    are failed as `ROLE_CHANGED`, which the router migrates."""

    spec: str


__all__ = ["ROLE_CHANGED", "RoleChangeRequest", "RoleChangeResult", "RoleStamp", "RoleSwitch", "SwitchRole"]
