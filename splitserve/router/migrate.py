"""Requests that outlive a worker's fault: a choice whose worker dies under it goes on elsewhere.

The router knows a choice's prompt and every token it has streamed. A choice's life (`migrating`):
  1. An attempt drives the choice through the workers (`Dispatcher._attempt`: prefill then decode, or
     one colocated worker); each piece it yields is passed on and its tokens remembered.
  2. The attempt ends with a worker's fault (`fault_cause`: the worker's process or engine core died,
     its connection failed, its stream was cut or ended unfinished, the KV it exported could not be
     fetched): unless the manifest says
     `router.on_fault: fail`, the choice migrates. The next attempt sends the prompt plus the tokens
     already streamed, with `resumed` = how many of those tokens are the completion's own, to workers
     other than the one that failed (a restarted one has a new address, and is taken): the prefill
     worker computes their KV and samples the next token, the decode worker goes on from there, and
     the client sees one unbroken stream. A prefill worker's fault is a migration with nothing
     streamed: the prompt is prefilled again.
  3. Anything else ends the choice with its error, as without migration: the input refused, a stage's
     deadline, the request's own deadline, or more than `router.max_migrations` faults (so a request
     that kills every worker it lands on stops after that many).
A worker that changed role since it was picked answers 409 `stale_role` before it starts anything:
the choice picks again, another worker (`REPICKS` times at most), which is neither a fault nor a
migration. A worker
that changes role hands back what is still in flight at its drain deadline (`role_changed`): those
choices migrate.
Every migration is logged (one WARNING line: `migrated`, the cause, the worker, the tokens streamed)
and counted (`splitserve:request_migrations` by cause). While every worker of a role is (re)starting,
a request waits for one (`Dispatcher._pick`), within its deadline and `router.worker_wait_s`.

Greedy choices are token-exact with a fault-free run: the next token's logits come from a prefill of
the same tokens instead of a decode step, equal up to floating-point rounding (see docs/restarts.md).
So are seeded sampled ones, and constrained ones keep their grammar: the new worker's engine takes the
`resumed` tokens as the request's own output (sampling/params.py), its seeded generator moved past
their draws, its grammar's matcher and thinking gate past the tokens themselves.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from prometheus_client import CollectorRegistry, Counter

from splitserve.config.manifest_sections import RouterSection
from splitserve.router.openai_protocol import APIError
from splitserve.sampling.params import SamplingParams

log = logging.getLogger(__name__)

# APIError codes (dispatch.py, worker_answers.py) that mean the worker failed, not the request
FAULTS = {
    "worker_failed": "worker failed",  # the connection failed or the stream was cut (the process died)
    "worker_aborted": "stream ended unfinished",  # the worker ended it with "abort" or "error"
    "engine_dead": "engine core died",  # the worker's front end answered that its core is gone
    "engine_stopped": "engine core stopped",
    "worker_stalled": "no token within inter_token_s",  # mid-stream (before the first: a deadline)
    # the decode worker could not fetch the prompt's KV: the prefill worker's fault (it died or stopped
    # after its answer), so it is the one avoided (`transport.policy: recompute` never gets here)
    "kv_transfer_failed": "KV transfer failed",
    "kv_transport": "KV transport failed",
    "role_changed": "worker changed role",  # still in flight when its drain ended (runtime/role_switch.py)
}
KV_FAULTS = ("kv_transfer_failed", "kv_transport")  # not a timeout: an overloaded decode worker is no fault
REPICK = "stale_role"  # a worker's answer: it changed role since it was picked
REPICKS = 8  # 409 stale_role answers one choice takes (a worker picked just as it changed role)
AVOID_S = 10.0  # a worker that failed a choice is not picked for it again for this long (same address)


class _Piece(Protocol):
    token_ids: list[int]
    finished: bool


class _Worker(Protocol):
    name: str
    url: str | None


@dataclass
class Attempt:
    """One try at a choice: the workers it must not pick, the request's deadline, the worker it is on."""

    deadline: float | None = None  # time.perf_counter() by which the request must end
    avoid: dict[tuple[str, str | None], float] = field(default_factory=dict)  # (name, url) -> until
    worker: _Worker | None = None  # the worker the attempt talks to now

    def allowed(self, worker: _Worker) -> bool:
        until = self.avoid.get((worker.name, worker.url))
        return until is None or time.perf_counter() >= until

    def on(self, worker: _Worker) -> None:
        self.worker = worker


AttemptFn = Callable[[int, list[int], SamplingParams, str, int, Attempt], AsyncIterator[Any]]


def fault_cause(exc: APIError) -> str | None:
    """The worker fault `exc` reports (a key of FAULTS), or None when it is not a worker's fault."""
    return exc.code if exc.code in FAULTS else None


async def migrating(
    attempt: AttemptFn,
    config: RouterSection,
    index: int,
    prompt_ids: list[int],
    params: SamplingParams,
    request_id: str,
    deadline: float | None = None,
    on_migrated: Callable[[str], None] | None = None,
) -> AsyncIterator[Any]:
    """The choice's pieces, over as many attempts as its faults take (see the module doc).
    `on_migrated(cause)` is told of each migration, and of each re-pick (`REPICK`)."""
    streamed: list[int] = []
    at = Attempt(deadline)
    migrations = repicks = 0
    while True:
        rid = request_id if not migrations else f"{request_id}-m{migrations}"
        rid = rid if not repicks else f"{rid}-r{repicks}"
        try:
            async for piece in attempt(index, prompt_ids + streamed, params, rid, len(streamed), at):
                streamed += piece.token_ids
                yield piece
            return
        except APIError as exc:
            if exc.code == REPICK and repicks < REPICKS:
                repicks += 1
                if at.worker is not None:  # the router's view of it lags: another worker for this choice
                    at.avoid[(at.worker.name, at.worker.url)] = time.perf_counter() + AVOID_S
                    at.worker = None
                log.info("request %s: choice %d picks again: %s", request_id, index, exc.message)
                if on_migrated is not None:
                    on_migrated(REPICK)
                continue
            cause = fault_cause(exc)
            worker = at.worker
            late = deadline is not None and time.perf_counter() >= deadline
            if cause is None or worker is None or late or config.on_fault == "fail":
                raise
            if migrations >= config.max_migrations:
                log.warning("request %s: choice %d not migrated: %d migrations already (%s on %s)",
                            request_id, index, migrations, FAULTS[cause], worker.name)  # fmt: skip
                raise
            migrations += 1
            at.avoid[(worker.name, worker.url)] = time.perf_counter() + AVOID_S
            at.worker = None
            log.warning("request %s: choice %d migrated (%s on %s, %d tokens streamed): %s", request_id,
                        index, FAULTS[cause], worker.name, len(streamed), exc.message)  # fmt: skip
            if on_migrated is not None:
                on_migrated(cause)


def migration_counter(registry: CollectorRegistry, model: str) -> Callable[[str], None]:
    """`splitserve:request_migrations{model_name, cause}` in `registry`, each cause at 0 from the start,
    and `splitserve:request_repicks{model_name}`; -> the call that counts one migration by its cause, or
    one re-pick (`REPICK`)."""
    counter = Counter(
        "splitserve:request_migrations",
        "Choices of requests moved to another worker after a worker's fault, by cause",
        ["model_name", "cause"],
        registry=registry,
    )
    for cause in FAULTS:
        counter.labels(model, cause)
    why = "Choices picked again after a worker answered that it changed role (409 stale_role)"
    repicks = Counter("splitserve:request_repicks", why, ["model_name"], registry=registry).labels(model)
    return lambda cause: repicks.inc() if cause == REPICK else counter.labels(model, cause).inc()


__all__ = [
    "FAULTS",
    "KV_FAULTS",
    "REPICK",
    "REPICKS",
    "Attempt",
    "fault_cause",
    "migrating",
    "migration_counter",
]
