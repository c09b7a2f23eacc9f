"""Requests waiting for their grammar, outside the scheduler and holding no KV (engine.py's
`add_request` puts them here when their compile is not done; each step's `admit` queues those whose
compile is, and fails those whose compile failed or ran past the deadline)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future

from splitserve.engine.grammar import Grammars, GrammarTimeout
from splitserve.engine.request import Request, Status
from splitserve.sampling.grammar_check import GrammarError


class GrammarWaits:
    def __init__(self, grammars: Grammars, timeout_s: float) -> None:
        self.grammars, self.timeout_s = grammars, timeout_s
        self._waiting: list[tuple[Future, list[Request], float]] = []  # (compile, children, asked at)
        self.failures: list[tuple[str, Exception]] = []  # (request id, why) of `admit`, until taken

    def take_failures(self) -> list[tuple[str, Exception]]:
        out, self.failures = self.failures, []
        return out

    def __bool__(self) -> bool:
        return bool(self._waiting)

    def futures(self) -> list[Future]:
        return [f for f, _, _ in self._waiting]

    def add(self, compiled: Future, children: list[Request]) -> None:
        self._waiting.append((compiled, children, time.monotonic()))

    def admit(self, queue: Callable[[Request], None]) -> list[tuple[str, Exception]]:
        """`queue` each child whose grammar compiled (its matcher set); end the others that are due
        with "abort". -> (parent request id, GrammarError or GrammarTimeout) of each that failed."""
        waiting, failed = [], []
        for fut, children, since in self._waiting:
            live = [c for c in children if not c.finished]  # not aborted while it compiled
            if not live:
                continue
            if not fut.done() and not self.grammars.late(since, self.timeout_s):
                waiting.append((fut, children, since))
                continue
            error = self._error(fut)
            if error is None:
                try:
                    compiled, make = fut.result(), self.grammars.for_request
                    for child in live:
                        child.grammar = make(child.params, compiled, child.earlier_output)
                except GrammarError as exc:  # a resumed answer its grammar refuses
                    error = exc
            for child in live:
                if error is None:
                    queue(child)
                else:
                    child.status, child.finish_reason = Status.FINISHED, "abort"
            if error is not None:
                failed.append((live[0].parent_id or live[0].request_id, error))
        self._waiting = waiting
        self.failures += failed
        return failed

    def _error(self, fut: Future) -> Exception | None:
        if not fut.done():
            return GrammarTimeout(f"the grammar did not compile within {self.timeout_s:g} s")
        if fut.cancelled():
            return GrammarError("the grammar's compile was cancelled")
        error = fut.exception()
        return error if isinstance(error, Exception) or error is None else GrammarError(str(error))

    def cancel_for(self, aborted: list[Request]) -> None:
        """Cancel the compiles that no request but the `aborted` ones waits for (if not started)."""
        specs = {r.params.grammar.key: r.params.grammar for r in aborted if r.params.grammar is not None}
        gone = {id(r) for r in aborted}
        for _, children, _ in self._waiting:
            for c in children:
                if id(c) not in gone and not c.finished and c.params.grammar is not None:
                    specs.pop(c.params.grammar.key, None)
        for spec in specs.values():
            self.grammars.cancel(spec)


__all__ = ["GrammarWaits"]
