"""The engine's port for its KV transfers (kv_transfer.py's `EnginePort`): what a KV import may do to
the engine's requests and ask of its grammars, and nothing else of the engine.

An import (decode side) builds its request as `add_request` would (validated, not queued), counts it as
the engine's while its KV loads, and, once the load ended, has it adopted: queued with its prompt
computed (or not: recompute) and the first token sampled by the prefill engine appended, whose output
goes out with the next step, before a forward pass; a constrained one is adopted only once its grammar
has compiled. An import that failed is forgotten; one aborted
while loading leaves its final output for the next step.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from splitserve.engine.grammar import Grammars
from splitserve.engine.intake import RequestFactory
from splitserve.engine.request import Request, RequestOutput
from splitserve.engine.scheduler import Scheduler
from splitserve.engine.table import RequestTable
from splitserve.sampling.logprobs import TokenLogprob
from splitserve.sampling.params import SamplingParams


class TransferPort:
    """LLMEngine's `EnginePort`, over the parts it shares with the engine."""

    def __init__(self, table: RequestTable, scheduler: Scheduler, intake: RequestFactory, grammars: Grammars):
        self._table, self._scheduler, self._intake, self._grammars = table, scheduler, intake, grammars

    def build_request(self, prompt: Sequence[int], params: SamplingParams, request_id: str) -> Request:
        """One request (n == 1), validated as `add_request` does, but not queued."""
        if params.n != 1:
            raise ValueError("a request with n > 1 cannot take part in a KV transfer")
        self._table.check_free(request_id)
        prompt_ids = self._intake.prompt_ids(prompt)
        max_tokens = self._intake.max_tokens(prompt_ids, params)
        if params.grammar is not None:
            self._grammars.compile(params.grammar)  # started now, used by adopt after the fetch
        return self._intake.child(request_id, prompt_ids, params, 0, max_tokens)

    def register(self, req: Request) -> None:
        """Count a request from `build_request` as the engine's (unfinished) from now on."""
        self._table.add(req.request_id, [req])

    def forget(self, request_id: str) -> None:
        """Drop a registered request that ended without an output (its import failed)."""
        self._table.pop(request_id)

    def post_output(self, output: RequestOutput) -> None:
        """An output made outside a step: the next `step()` returns it."""
        self._table.due.post(output)

    def grammar_compiling(self, req: Request) -> bool:
        """Whether `req`'s grammar is still compiling (an import's load that ended waits for it)."""
        return req.params.grammar is not None and not self._grammars.compile(req.params.grammar).done()

    def grammar_late(self, since: float, timeout_s: float) -> bool:
        """Whether a compile asked for at `since` (time.monotonic()) is past `timeout_s`."""
        return self._grammars.late(since, timeout_s)

    def adopt(self, req: Request, first_token: int, logprob: TokenLogprob | None, computed: int) -> None:
        """A request from `build_request` (registered now if it is not yet) whose KV wait ended: queue it
        first with its prompt's first `computed` tokens computed (KV loaded: all; recompute: 0) and its
        first token sampled elsewhere. The next step() returns that token's output before any forward
        pass (the stream's first line does not wait for the second token)."""
        if not self._table.holds(req):
            self._table.check_free(req.request_id)
            self.register(req)
        # a resumed answer's earlier output, then the first token (below), replayed into the matcher
        req.grammar = self._grammars.for_request(req.params, None, req.earlier_output)
        self._scheduler.kv_loaded(req, computed)
        req.first_token_time = time.monotonic()
        self._scheduler.append_token(req, first_token, logprob)
        self._table.due.post(self._table.output(req.request_id), first_token=True)


__all__ = ["TransferPort"]
