"""When a step raises anyway: pin it on the request(s) that cause it, and re-run the rest.

Admission validates every request (sampling/params.py, engine.add_request), so a step should not raise. If one
does, failing every request in the batch would tell innocent clients that their request went wrong.
`rerun_alone` instead steps each request of the batch on its own (the others wait, untouched): a
request whose own step raises is the culprit, and is aborted; the others made one step of progress,
their outputs returned as a normal step's. A fault no single request reproduces is pinned on nobody.

Test hook (off unless set, never in production): `SPLITSERVE_TEST_STEP_FAULT_TOKEN=ID` makes any step
whose chunks compute token ID raise, as a poison request would (runner.py calls `check_fault`).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from splitserve.engine.request import RequestOutput
    from splitserve.engine.scheduler import ScheduledChunk

log = logging.getLogger(__name__)

_FAULT = os.environ.get("SPLITSERVE_TEST_STEP_FAULT_TOKEN")
FAULT_TOKEN: int | None = int(_FAULT) if _FAULT else None


class InjectedStepFault(RuntimeError):
    """Raised by the test hook: a step computed the poison token."""


def check_fault(chunks: Sequence[ScheduledChunk]) -> None:
    """The test hook (a no-op unless SPLITSERVE_TEST_STEP_FAULT_TOKEN is set)."""
    if FAULT_TOKEN is None:
        return
    for c in chunks:
        if FAULT_TOKEN in c.request.token_ids(c.start, c.start + c.num_tokens):
            raise InjectedStepFault(f"injected step fault: token {FAULT_TOKEN} in {c.request.request_id}")


class Steppable(Protocol):
    """What `rerun_alone` uses of an engine (LLMEngine)."""

    def has_request(self, request_id: str) -> bool: ...

    def step_only(self, request_ids: set[str]) -> list[RequestOutput]: ...

    def abort(self, request_id: str) -> None: ...


def rerun_alone(
    engine: Steppable, request_ids: Sequence[str]
) -> tuple[list[RequestOutput], dict[str, BaseException]]:
    """After `engine.step()` raised: step each of `request_ids` alone. -> (the outputs of those whose
    step went through, {request id: its exception} for those whose own step raised; these are aborted,
    their blocks freed)."""
    outputs: list[RequestOutput] = []
    culprits: dict[str, BaseException] = {}
    for rid in request_ids:
        if not engine.has_request(rid):
            continue  # finished or aborted meanwhile
        try:
            outputs += engine.step_only({rid})
        except Exception as exc:  # noqa: BLE001 - the culprit: reported to its caller
            log.warning("request %s alone makes the engine step raise (%s: %s): failed; the others go on",
                        rid, type(exc).__name__, exc)  # fmt: skip
            engine.abort(rid)
            culprits[rid] = exc
    return outputs, culprits


__all__ = ["FAULT_TOKEN", "InjectedStepFault", "check_fault", "rerun_alone"]
