"""Constrained requests waiting for their grammar to compile, outside the scheduler.

`add_request` starts the compile (grammar.py: on a thread, cached per spec); a request whose grammar is
not compiled yet waits here, so a slow compile never stalls the step that runs the other requests.
Each step's poll admits those whose grammar is ready, each child with its own matcher.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import FIRST_COMPLETED, Future, wait

from splitserve.engine.grammar import Grammars
from splitserve.engine.request import Request, Status


class GrammarWait:
    def __init__(self, grammars: Grammars) -> None:
        self.grammars = grammars
        self._waiting: list[tuple[Future, list[Request]]] = []

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def add(self, compiled: Future, children: list[Request]) -> None:
        """`children` (a request's n samples) wait for `compiled` (`Grammars.compile`'s future)."""
        self._waiting.append((compiled, children))

    def wait(self, timeout_s: float) -> None:
        """Block until a grammar is compiled, or `timeout_s` passed (nothing else to do: not spin)."""
        wait([f for f, _ in self._waiting], timeout=timeout_s, return_when=FIRST_COMPLETED)

    def admit(self, queue: Callable[[Request], None]) -> list[tuple[Request, BaseException]]:
        """`queue` each request whose grammar compiled, with its matcher; one whose grammar failed (the
        front ends check specs first, so hardly ever) is finished with "abort". -> (the first live child,
        the error) of each failed request, whose output is due."""
        waiting: list[tuple[Future, list[Request]]] = []
        failed: list[tuple[Request, BaseException]] = []
        for fut, children in self._waiting:
            if not fut.done():
                waiting.append((fut, children))
                continue
            error = fut.exception()
            live = [c for c in children if not c.finished]  # not aborted while it compiled
            for child in live:
                if error is None:
                    child.grammar = self.grammars.matcher(child.params.grammar, fut.result())
                    queue(child)
                else:
                    child.status, child.finish_reason = Status.FINISHED, "abort"
            if error is not None and live:
                failed.append((live[0], error))
        self._waiting = waiting
        return failed


__all__ = ["GrammarWait"]
